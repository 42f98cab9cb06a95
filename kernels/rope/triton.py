"""Rotary position embedding, Triton (twin: reference.py). NeoX / rotate-half layout.

One program per (token, BLOCK_H heads): the angle row pos * inv_freq is shared by the token's heads.
cos/sin are computed in the kernel in fp32 by default; ``use_table=True`` gathers them from an fp32
[T, D] table (cos | sin) built by torch instead. bench/kernels.py times both (see bench/kernels.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.rope.reference import rope_cos_sin


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, invf_ptr, tab_ptr, out_ptr, n_heads, half,
                 stride_xt, stride_xh, stride_ot, stride_oh,
                 BLOCK_H: tl.constexpr, BLOCK_D2: tl.constexpr, USE_TABLE: tl.constexpr):
    t = tl.program_id(0)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D2)
    d_ok = d < half
    ok = (hh[:, None] < n_heads) & d_ok[None, :]
    if USE_TABLE:
        cos = tl.load(tab_ptr + t * 2 * half + d, mask=d_ok, other=1.0)
        sin = tl.load(tab_ptr + t * 2 * half + half + d, mask=d_ok, other=0.0)
    else:
        ang = tl.load(pos_ptr + t).to(tl.float32) * tl.load(invf_ptr + d, mask=d_ok, other=0.0)
        cos = tl.cos(ang)
        sin = tl.sin(ang)
    x_row = x_ptr + t.to(tl.int64) * stride_xt + hh[:, None] * stride_xh + d[None, :]
    x1 = tl.load(x_row, mask=ok, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_D2]
    x2 = tl.load(x_row + half, mask=ok, other=0.0).to(tl.float32)
    o_row = out_ptr + t.to(tl.int64) * stride_ot + hh[:, None] * stride_oh + d[None, :]
    tl.store(o_row, (x1 * cos[None, :] - x2 * sin[None, :]).to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(o_row + half, (x2 * cos[None, :] + x1 * sin[None, :]).to(out_ptr.dtype.element_ty), mask=ok)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, use_table: bool = False) -> torch.Tensor:
    """Rotate x [T, H, D] by its positions [T] (int). Returns a new tensor in x's dtype."""
    if x.dim() != 3 or positions.shape != x.shape[:1]:
        raise ValueError(f"apply_rope expects x [T, H, D] and positions [T], got {tuple(x.shape)} and {tuple(positions.shape)}")
    t, n_heads, dim = x.shape
    if dim % 2 or inv_freq.numel() != dim // 2:
        raise ValueError(f"head_dim {dim} needs {dim // 2} inverse frequencies, got {inv_freq.numel()}")
    if x.stride(2) != 1:
        x = x.contiguous()
    out = torch.empty((t, n_heads, dim), dtype=x.dtype, device=x.device)
    if t == 0 or n_heads == 0:
        return out
    inv_freq = inv_freq.to(device=x.device, dtype=torch.float32).contiguous()
    positions = positions.contiguous()
    table = torch.cat(rope_cos_sin(positions, inv_freq), dim=-1) if use_table else inv_freq
    block_h = min(triton.next_power_of_2(n_heads), 16)
    _rope_kernel[(t, triton.cdiv(n_heads, block_h))](
        x, positions, inv_freq, table, out, n_heads, dim // 2,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        BLOCK_H=block_h, BLOCK_D2=triton.next_power_of_2(dim // 2), USE_TABLE=use_table)
    return out
