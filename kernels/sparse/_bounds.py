"""Triton page bounds: kmin / kmax of given blocks over their visible slots, in one launch.

One program per row (block id) of the call. It first ORs the visible slots of every row that names its block (a block
named twice gets the bounds of the union of its rows' slots, as the twin's scatter_reduce gives it): a scan of the
block ids, SCAN at a time, that reads a row's slots only where its id matches. Then it takes the elementwise min and
max over those slots of the block's keys, [BS, Hkv * D] in BLOCK_C-wide column tiles, and writes them in the pool's
dtype (+inf / -inf where no slot is visible). Rows naming one block write the same values. No host sync: a decode
graph replays it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_SCAN = 1024     # block ids compared per step of the union scan
MAX_COLS = 1024     # key columns (heads x head dim) per tile: [16, 1024] bf16 is 64 values a thread at 8 warps
NUM_WARPS = 8


@triton.jit
def _bounds_kernel(k_ptr, kmin_ptr, kmax_ptr, blk_ptr, vis_ptr, n_rows,
                   stride_kb, stride_ks, stride_kh, stride_mb, stride_mh, stride_vr,
                   BS: tl.constexpr, BS_PAD: tl.constexpr, D: tl.constexpr, COLS: tl.constexpr,
                   BLOCK_C: tl.constexpr, SCAN: tl.constexpr):
    blk = tl.load(blk_ptr + tl.program_id(0)).to(tl.int64)
    s = tl.arange(0, BS_PAD)
    s_ok = s < BS
    # the union of the slots every row naming this block shows
    shown = tl.zeros([BS_PAD], tl.int32)
    for j0 in range(0, n_rows, SCAN):
        j = j0 + tl.arange(0, SCAN)
        same = (tl.load(blk_ptr + j, mask=j < n_rows, other=-1).to(tl.int64) == blk) & (j < n_rows)
        v = tl.load(vis_ptr + j.to(tl.int64)[:, None] * stride_vr + s[None, :], mask=same[:, None] & s_ok[None, :],
                    other=0)
        shown = tl.maximum(shown, tl.max(v.to(tl.int32), axis=0))
    vis = (shown != 0) & s_ok
    k_blk = k_ptr + blk * stride_kb + s[:, None] * stride_ks
    m_blk = blk * stride_mb
    for c0 in tl.static_range(0, COLS, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        c_ok = c < COLS
        head = c // D
        dim = c % D
        k = tl.load(k_blk + (head * stride_kh + dim)[None, :], mask=vis[:, None] & c_ok[None, :]).to(tl.float32)
        lo = tl.min(tl.where(vis[:, None], k, float("inf")), axis=0)    # [BLOCK_C]
        hi = tl.max(tl.where(vis[:, None], k, float("-inf")), axis=0)
        m_off = m_blk + head * stride_mh + dim
        tl.store(kmin_ptr + m_off, lo.to(kmin_ptr.dtype.element_ty), mask=c_ok)
        tl.store(kmax_ptr + m_off, hi.to(kmax_ptr.dtype.element_ty), mask=c_ok)


def launch(k_cache: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, blocks: torch.Tensor,
           visible: torch.Tensor) -> None:
    """Inputs checked by triton.py (visible: uint8 [n, BS] with unit slot stride). Writes kmin, kmax in place."""
    n_rows = blocks.numel()
    if not n_rows:
        return
    _, bs, hkv, dim = k_cache.shape
    cols = hkv * dim
    _bounds_kernel[(n_rows,)](
        k_cache, kmin, kmax, blocks, visible, n_rows,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), kmin.stride(0), kmin.stride(1), visible.stride(0),
        BS=bs, BS_PAD=triton.next_power_of_2(bs), D=dim, COLS=cols, BLOCK_C=min(MAX_COLS, triton.next_power_of_2(cols)),
        SCAN=min(MAX_SCAN, triton.next_power_of_2(n_rows)), num_warps=NUM_WARPS)
