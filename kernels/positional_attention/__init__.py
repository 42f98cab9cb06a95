"""Attention of queries at given positions over keys laid one per position (key j at position j): query t sees
the keys at positions <= q_pos[t]; a query at a negative position sees none and outputs 0.

What CacheBlend's recompute layers need once every position's key is gathered in order (the recomputed
tokens' fresh keys in place of their cached twins): the selected tokens sit at scattered positions, so
neither a top-left nor a bottom-right causal mask fits, but the mask is still a position test, not a tensor.
"""

from __future__ import annotations

import torch

from kernels.positional_attention.reference import positional_attention as positional_attention_reference


def positional_attention(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         backend: str = "torch") -> torch.Tensor:
    """q [T, Hq, D] at positions q_pos [T] (int), k, v [S, Hkv, D] (Hq a multiple of Hkv) -> out [T, Hq, D]."""
    if backend == "torch":
        return positional_attention_reference(q, q_pos, k, v, scale)
    if backend == "triton":
        from kernels.positional_attention.triton import positional_attention as positional_attention_triton

        return positional_attention_triton(q, q_pos, k, v, scale)
    raise ValueError(f"unknown backend {backend!r} (torch or triton)")
