"""RoPE: ``apply_rope`` and ``gather_rotate`` dispatch to the plain-torch twin or the Triton kernel."""

from __future__ import annotations

import torch

from kernels.rope.reference import apply_rope as apply_rope_reference
from kernels.rope.reference import gather_rotate as gather_rotate_reference
from kernels.rope.reference import rope_cos_sin, rope_inv_freq, rotate

__all__ = ["apply_rope", "gather_rotate", "rope_inv_freq", "rope_cos_sin", "rotate"]


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """Rotate x [T, H, D] at integer positions [T] (NeoX layout, fp32 math, x's dtype out)."""
    if backend == "torch":
        return apply_rope_reference(x, positions, inv_freq)
    if backend == "triton":
        from kernels.rope.triton import apply_rope as apply_rope_triton

        return apply_rope_triton(x, positions, inv_freq)
    raise ValueError(f"unknown backend {backend!r} (torch or triton)")


def gather_rotate(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor, offsets: torch.Tensor,
                  inv_freq: torch.Tensor, backend: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """Every slot of paged blocks block_ids [E] flat, k, v [E*BS, H, D], keys of block e rotated by offsets[e]."""
    if backend == "torch":
        return gather_rotate_reference(k_cache, v_cache, block_ids, offsets, inv_freq)
    if backend == "triton":
        from kernels.rope.triton import gather_rotate as gather_rotate_triton

        return gather_rotate_triton(k_cache, v_cache, block_ids, offsets, inv_freq)
    raise ValueError(f"unknown backend {backend!r} (torch or triton)")
