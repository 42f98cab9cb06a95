"""Triton form of kernels/sparse/retro.py's ``new_pages``: one program per (past row, KV head) tests its candidate
pages against the pages it has seen, tile by tile, and compacts the new ones with a prefix sum."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SEEN_TILE = 64


@triton.jit
def _new_pages_kernel(sel_in_ptr, seq_ptr, ent_ptr, seen_ptr, cu_ptr, sel_ptr, cnt_ptr, width,
                      s_lb, s_lh, s_sr, s_sh, s_or, s_oh,
                      K: tl.constexpr, K_PAD: tl.constexpr, TILE: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(seq_ptr + r).to(tl.int64)
    start = tl.load(cu_ptr + b).to(tl.int64)
    kk = tl.arange(0, K_PAD)
    picked = tl.load(sel_in_ptr + b * s_lb + h * s_lh + kk, mask=kk < K, other=-1).to(tl.int64)
    cand = tl.where(picked >= 0, picked - start, -1)                 # within the sequence
    limit = tl.load(ent_ptr + r).to(tl.int64)
    new = (cand >= 0) & (cand < limit)
    seen_row = seen_ptr + r.to(tl.int64) * s_sr + h * s_sh
    for w0 in range(0, width, TILE):
        ww = w0 + tl.arange(0, TILE)
        s = tl.load(seen_row + ww, mask=ww < width, other=-1).to(tl.int64)
        hit = tl.max((cand[:, None] == s[None, :]).to(tl.int32), axis=1)
        new = new & (hit == 0)
    take = new.to(tl.int32)
    pos = tl.cumsum(take, axis=0) - take
    count = tl.sum(take, axis=0)
    out_row = sel_ptr + r.to(tl.int64) * s_or + h * s_oh
    # every slot at or past the count is -1, each written once: the new pages land at their ranks below it
    tl.store(out_row + kk, tl.full([K_PAD], -1, tl.int32), mask=(kk < K) & (kk >= count))
    tl.store(out_row + pos, picked.to(tl.int32), mask=new)
    tl.store(cnt_ptr + r.to(tl.int64) * tl.num_programs(1) + h, count)


def new_pages_triton(picked, seq_of, entries, seen, cu):
    r, hkv, w = seen.shape
    k = picked.shape[-1]
    sel = torch.empty((r, hkv, k), dtype=torch.int32, device=picked.device)
    count = torch.empty((r, hkv), dtype=torch.int32, device=picked.device)
    if r and hkv:
        picked, seen = picked.contiguous(), seen.contiguous()
        _new_pages_kernel[(r, hkv)](
            picked, seq_of, entries, seen, cu, sel, count, w,
            picked.stride(0), picked.stride(1), seen.stride(0), seen.stride(1), sel.stride(0), sel.stride(1),
            K=k, K_PAD=triton.next_power_of_2(max(k, 1)), TILE=SEEN_TILE)
    return sel, count


