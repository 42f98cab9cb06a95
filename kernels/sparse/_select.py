"""Triton page selection: per (sequence, KV head), the last entry and the top (budget - 1) of the others.

One program per (sequence, KV head). The m-th largest score T among the row's selectable others (m = budget - 1,
or fewer when fewer are selectable) is found by bisection over an order-preserving 32-bit key of each fp32 score
(flip the sign bit of positives, every bit of negatives): T = the largest key with count(key >= T) >= m, built
bit by bit from the top, 32 counting passes; none when every selectable entry fits (short contexts).
Then, in index order, every key > T is taken and the first m - count(key > T) keys == T (ties broken by the
lowest entry): exactly m entries, written ascending through a prefix sum; the last entry after them; -1 past.

A row of up to BLOCK entries stays in registers for all its passes; a longer row (more than MAX_BLOCK entries: over
128K tokens at 16 a page) re-reads its scores every pass, tile by tile. -inf (a page with no visible slot) and NaN
are never selected.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 8192  # row entries kept in registers: 16 warps hold 16 int64 keys a thread
PAD_BLOCK = 128   # -1 padding written this many slots at a time


@triton.jit
def _keys(row_ptr, first, n, stride_e, BLOCK: tl.constexpr):
    """Keys of entries first .. first + BLOCK - 1 (the first n of them real) of one KV head's scores: int64 in
    [0, 2**32), ordered as the scores; ok marks the selectable (not -inf, not NaN)."""
    i = tl.arange(0, BLOCK)
    s = tl.load(row_ptr + (first + i).to(tl.int64) * stride_e, mask=i < n, other=float("-inf"))
    ok = s > float("-inf")
    bits = s.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) + 2147483648
    return key, ok


@triton.jit
def _emit(key, ok, first, T, need_eq, eq_seen, written, out_row, BLOCK: tl.constexpr):
    """Write the tile's selected entries (global indices first + i) at out_row[written + rank]. -> running counts."""
    eq = ok & (key == T)
    eq_rank = tl.cumsum(eq.to(tl.int32), axis=0) - eq.to(tl.int32) + eq_seen
    take = (ok & (key > T)) | (eq & (eq_rank < need_eq))
    pos = tl.cumsum(take.to(tl.int32), axis=0) - take.to(tl.int32) + written
    tl.store(out_row + pos, (first + tl.arange(0, BLOCK)).to(tl.int32), mask=take)
    return eq_seen + tl.sum(eq.to(tl.int32), axis=0), written + tl.sum(take.to(tl.int32), axis=0)


@triton.jit
def _select_kernel(scores_ptr, cu_ptr, sel_ptr, cnt_ptr, budget,
                   stride_se, stride_ob, stride_oh, stride_cb,
                   BLOCK: tl.constexpr, PAD_BLOCK: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    e_lo = tl.load(cu_ptr + b)
    e_hi = tl.load(cu_ptr + b + 1)
    n = tl.maximum(e_hi - e_lo - 1, 0)  # the others: every entry but the last
    row = scores_ptr + h
    out_row = sel_ptr + b.to(tl.int64) * stride_ob + h * stride_oh
    written = tl.zeros([], tl.int32)
    eq_seen = tl.zeros([], tl.int32)
    T = tl.zeros([], tl.int64)
    step = tl.full([], 2147483648, tl.int64)
    if n <= BLOCK:
        key, ok = _keys(row, e_lo, n, stride_se, BLOCK)
        n_ok = tl.sum(ok.to(tl.int32), axis=0)
        m = tl.minimum(budget - 1, n_ok)
        T = tl.where(m == 0, T + 4294967296, T)  # m = 0: a threshold above every key; m = n_ok: 0, below them
        if (m > 0) & (m < n_ok):
            for _ in range(32):
                c = tl.sum((ok & (key >= T + step)).to(tl.int32), axis=0)
                T = tl.where(c >= m, T + step, T)
                step = step // 2
        need_eq = m - tl.sum((ok & (key > T)).to(tl.int32), axis=0)
        eq_seen, written = _emit(key, ok, e_lo, T, need_eq, eq_seen, written, out_row, BLOCK)
    else:
        n_ok = tl.zeros([], tl.int32)
        for t in range(0, n, BLOCK):
            _, ok = _keys(row, e_lo + t, n - t, stride_se, BLOCK)
            n_ok += tl.sum(ok.to(tl.int32), axis=0)
        m = tl.minimum(budget - 1, n_ok)
        T = tl.where(m == 0, T + 4294967296, T)
        if (m > 0) & (m < n_ok):
            for _ in range(32):
                c = tl.zeros([], tl.int32)
                for t in range(0, n, BLOCK):
                    key, ok = _keys(row, e_lo + t, n - t, stride_se, BLOCK)
                    c += tl.sum((ok & (key >= T + step)).to(tl.int32), axis=0)
                T = tl.where(c >= m, T + step, T)
                step = step // 2
        above = tl.zeros([], tl.int32)
        for t in range(0, n, BLOCK):
            key, ok = _keys(row, e_lo + t, n - t, stride_se, BLOCK)
            above += tl.sum((ok & (key > T)).to(tl.int32), axis=0)
        need_eq = m - above
        for t in range(0, n, BLOCK):
            key, ok = _keys(row, e_lo + t, n - t, stride_se, BLOCK)
            eq_seen, written = _emit(key, ok, e_lo + t, T, need_eq, eq_seen, written, out_row, BLOCK)
    if e_hi > e_lo:
        if tl.load(row + (e_hi - 1).to(tl.int64) * stride_se) > float("-inf"):
            tl.store(out_row + written, e_hi - 1)
            written += 1
    tl.store(cnt_ptr + b * stride_cb + h, written)
    for p in range((written // PAD_BLOCK) * PAD_BLOCK, budget, PAD_BLOCK):
        k = p + tl.arange(0, PAD_BLOCK)
        tl.store(out_row + k, tl.full([PAD_BLOCK], -1, tl.int32), mask=(k >= written) & (k < budget))


def launch(scores: torch.Tensor, cu_entries: torch.Tensor, budget_pages: int,
           max_block: int = MAX_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """scores fp32 [E, Hkv] (contiguous), cu_entries int32 [B+1] -> (sel int32 [B, Hkv, K], count int32 [B, Hkv]).
    Rows longer than max_block entries (a power of two) take the tiled path (tests lower it to reach that path)."""
    n_entries, hkv = scores.shape
    n_seqs = cu_entries.numel() - 1
    sel = torch.empty((n_seqs, hkv, budget_pages), dtype=torch.int32, device=scores.device)
    count = torch.empty((n_seqs, hkv), dtype=torch.int32, device=scores.device)
    if n_seqs:
        # a row is at most E entries: small tables get small tiles (no host sync for the longest row)
        block = min(max_block, triton.next_power_of_2(max(16, n_entries)))
        _select_kernel[(n_seqs, hkv)](
            scores, cu_entries, sel, count, budget_pages,
            scores.stride(0), sel.stride(0), sel.stride(1), count.stride(0),
            BLOCK=block, PAD_BLOCK=PAD_BLOCK, num_warps=max(1, min(16, block // 512)))
    return sel, count
