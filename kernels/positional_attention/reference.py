"""Plain-torch twin of the positional attention kernel (SDPA with an additive mask; the torch backend's path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ValueError(f"q [T, Hq, D] and k, v [S, Hkv, D] expected, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key heads")
    if q_pos.shape != q.shape[:1]:
        raise ValueError(f"q_pos {tuple(q_pos.shape)} must be [T] for q {tuple(q.shape)}")


def positional_attention(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """q [T, Hq, D] at positions q_pos [T], k, v [S, Hkv, D] with key j at position j -> out [T, Hq, D]: query t
    over keys j <= q_pos[t]; 0 for a query at a negative position."""
    check(q, q_pos, k, v)
    pos = q_pos.long()
    seen = pos >= 0
    j = torch.arange(k.shape[0], device=q.device)
    # a row that sees nothing would be an empty softmax: it sees every key here, and its output is zeroed
    allowed = (j[None, :] <= pos[:, None]) | ~seen[:, None]
    mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
    group = q.shape[1] // k.shape[1]
    if group > 1:  # with a mask, CUDA's memory-efficient kernel takes the heads expanded (not enable_gqa)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask[None, None], scale=scale)
    return torch.where(seen[:, None, None], out[0].transpose(0, 1), 0.0)
