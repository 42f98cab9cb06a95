"""Rotary position embedding, Triton (twin: reference.py). NeoX / rotate-half layout.

One program per (token, BLOCK_H heads): the angle row pos * inv_freq is shared by the token's heads.
cos/sin are computed in the kernel in fp32 by default; ``use_table=True`` gathers them from an fp32
[T, D] table (cos | sin) built by torch instead. bench/kernels/kernels.py times both (see bench/kernels/README.md).

``gather_rotate`` reads whole paged blocks and writes them flat, keys rotated by their block's
offset on the way: one pass over K and V instead of a gather, an fp32 rotation in several
elementwise kernels and a cast (the torch backend's static tails use it before SDPA).
A view [M, 1, H, D] of a layer's flat slots makes every slot a block of its own: single slots in any
order, each key rotated by its own offset (the CacheBlend graph lays one key per position that way:
blend_tail.py).
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


@triton.jit
def _gather_rotate_kernel(k_ptr, v_ptr, ids_ptr, off_ptr, invf_ptr, ko_ptr, vo_ptr, rows, stride_kb, stride_vb,
                          HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D2: tl.constexpr):
    """Program (entry e, tile of BLOCK_R rows of its block's BS*H contiguous rows of D)."""
    e = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D2)
    ok = (r[:, None] < rows) & (d[None, :] < HALF)
    blk = tl.load(ids_ptr + e).to(tl.int64)
    ang = tl.load(off_ptr + e).to(tl.float32) * tl.load(invf_ptr + d, mask=d < HALF, other=0.0)
    cos = tl.cos(ang)[None, :]
    sin = tl.sin(ang)[None, :]
    src = r[:, None] * (2 * HALF) + d[None, :]
    dst = (e.to(tl.int64) * rows + r[:, None]) * (2 * HALF) + d[None, :]
    x1 = tl.load(k_ptr + blk * stride_kb + src, mask=ok, other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_D2]
    x2 = tl.load(k_ptr + blk * stride_kb + src + HALF, mask=ok, other=0.0).to(tl.float32)
    tl.store(ko_ptr + dst, (x1 * cos - x2 * sin).to(ko_ptr.dtype.element_ty), mask=ok)
    tl.store(ko_ptr + dst + HALF, (x2 * cos + x1 * sin).to(ko_ptr.dtype.element_ty), mask=ok)
    v1 = tl.load(v_ptr + blk * stride_vb + src, mask=ok, other=0.0)
    v2 = tl.load(v_ptr + blk * stride_vb + src + HALF, mask=ok, other=0.0)
    tl.store(vo_ptr + dst, v1, mask=ok)
    tl.store(vo_ptr + dst + HALF, v2, mask=ok)


def gather_rotate(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor, offsets: torch.Tensor,
                  inv_freq: torch.Tensor, block_r: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every slot of the blocks block_ids [E] (int) of paged caches [N, BS, H, D], flat: k, v [E*BS, H, D],
    block e's keys rotated forward by offsets[e] [E]. ``block_r``: rows of D a program (default: a block's
    BS*H rows, at most 32). No host sync: a CUDA graph can capture it."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be [N, BS, H, D]")
    n_blocks, bs, n_heads, dim = k_cache.shape
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.stride()[1:] != (n_heads * dim, dim, 1):
            raise ValueError(f"{name} must hold each block's [BS, H, D] contiguously")
    if block_ids.dim() != 1 or offsets.shape != block_ids.shape:
        raise ValueError(f"block_ids {tuple(block_ids.shape)} and offsets {tuple(offsets.shape)} must be 1-D of one length")
    if dim % 2 or inv_freq.numel() != dim // 2:
        raise ValueError(f"head_dim {dim} needs {dim // 2} inverse frequencies, got {inv_freq.numel()}")
    n = block_ids.numel()
    k_out = torch.empty((n * bs, n_heads, dim), dtype=k_cache.dtype, device=k_cache.device)
    v_out = torch.empty_like(k_out)
    if n == 0:
        return k_out, v_out
    rows = bs * n_heads
    block_r = block_r or min(32, triton.next_power_of_2(rows))
    inv_freq = inv_freq.to(device=k_cache.device, dtype=torch.float32).contiguous()
    _gather_rotate_kernel[(n, triton.cdiv(rows, block_r))](
        k_cache, v_cache, block_ids.contiguous(), offsets.contiguous(), inv_freq, k_out, v_out, rows,
        k_cache.stride(0), v_cache.stride(0),
        HALF=dim // 2, BLOCK_R=block_r, BLOCK_D2=triton.next_power_of_2(dim // 2))
    return k_out, v_out

