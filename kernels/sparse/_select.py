"""Triton page selection: per (sequence, KV head), the last entry and the top (budget - 1) of the others.

One program per (sequence, KV head). Each fp32 score becomes an order-preserving signed 32-bit key (every bit but the
sign flipped for negatives). The m-th largest key among the row's selectable others (m = budget - 1, or fewer when
fewer are selectable) is found by a radix select from the top, RADIX_BITS bits a pass (the first pass takes what is
left over, sign included): a histogram (tl.histogram) of the next digit of the keys still in the bucket, and the
digit where the count from the top reaches m narrows the bucket. It stops as soon as the bucket holds exactly as many
keys as are still needed (distinct scores: after a few passes), or after the last bit. 32 one-bit counting passes
were the previous kernel; each pass is a reduction across the program's warps, so their latency was the kernel's.

Then, in index order, every key above the bucket is taken and the first (needed) keys in it (ties broken by the
lowest entry): exactly m entries, written ascending through a prefix sum; the last entry after them; -1 past.

A row of up to BLOCK entries stays in registers for all its passes; a longer row re-reads its scores every pass,
tile by tile (the launcher sizes BLOCK by the table's mean row, so one long row of a batch takes that path).
-inf (a page with no visible slot) and NaN are never selected.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 8192  # row entries kept in registers: 16 warps hold 16 int32 keys a thread
PAD_BLOCK = 128   # -1 padding written this many slots at a time
RADIX_BITS = 5    # bits a pass: 32 histogram bins, one a lane (tl.histogram pads fewer to 32)
INT32_MIN = tl.constexpr(-2147483648)
INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def _keys(row_ptr, first, n, stride_e, BLOCK: tl.constexpr):
    """Keys of entries first .. first + BLOCK - 1 (the first n of them real) of one KV head's scores: int32 ordered
    as the scores; ok marks the selectable (not -inf, not NaN)."""
    i = tl.arange(0, BLOCK)
    s = tl.load(row_ptr + (first + i).to(tl.int64) * stride_e, mask=i < n, other=float("-inf"))
    ok = s > float("-inf")
    bits = s.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits), ok


@triton.jit
def _digits(key, ok, prefix, r, FIRST_PASS: tl.constexpr, FIRST: tl.constexpr, W: tl.constexpr):
    """This pass's digit of each key and whether the key is in the bucket (its top r bits == prefix). The first
    pass: the top FIRST bits, sign included, shifted to start at 0 (every selectable key is in the bucket)."""
    if FIRST_PASS:
        dig = (key >> (32 - FIRST)) + (1 << (FIRST - 1))
        inb = ok
    else:
        dig = (key >> (32 - r - W)) & ((1 << W) - 1)
        inb = ok & ((key >> (32 - r)) == prefix)
    return dig, inb


@triton.jit
def _histogram(key, ok, row, e_lo, n, stride_e, prefix, r,
               FIRST_PASS: tl.constexpr, FIRST: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr):
    """Histogram [2**W] of the bucket's digits over the row: its first tile from registers, the rest (a row longer
    than BLOCK) re-read tile by tile."""
    dig, inb = _digits(key, ok, prefix, r, FIRST_PASS, FIRST, W)
    hist = tl.histogram(dig, 1 << W, mask=inb)
    for t in range(BLOCK, n, BLOCK):
        key_t, ok_t = _keys(row, e_lo + t, n - t, stride_e, BLOCK)
        dig, inb = _digits(key_t, ok_t, prefix, r, FIRST_PASS, FIRST, W)
        hist += tl.histogram(dig, 1 << W, mask=inb)
    return hist


@triton.jit
def _pick(hist, need, NBINS: tl.constexpr):
    """Histogram [NBINS] of the bucket's digits -> (the largest digit d with count(digit >= d) >= need, the count
    above d, the count at d)."""
    t = tl.arange(0, NBINS)
    from_top = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # count(digit >= t)
    d = tl.sum((from_top >= need).to(tl.int32), axis=0) - 1
    return d, tl.sum(tl.where(t > d, hist, 0), axis=0), tl.sum(tl.where(t == d, hist, 0), axis=0)


@triton.jit
def _emit(key, ok, first, r, prefix, need, eq_seen, written, out_row, BLOCK: tl.constexpr):
    """Write the tile's selected entries (global indices first + i) at out_row[written + rank]: the keys above the
    bucket (top r bits > prefix) and the first `need` in it, counting eq_seen met in earlier tiles. -> running counts."""
    top = key >> (32 - r)
    eq = ok & (top == prefix)
    eq_rank = tl.cumsum(eq.to(tl.int32), axis=0) - eq.to(tl.int32) + eq_seen
    take = (ok & (top > prefix)) | (eq & (eq_rank < need))
    pos = tl.cumsum(take.to(tl.int32), axis=0) - take.to(tl.int32) + written
    tl.store(out_row + pos, (first + tl.arange(0, BLOCK)).to(tl.int32), mask=take)
    return eq_seen + tl.sum(eq.to(tl.int32), axis=0), written + tl.sum(take.to(tl.int32), axis=0)


@triton.jit
def _select_kernel(scores_ptr, cu_ptr, sel_ptr, cnt_ptr, budget,
                   stride_se, stride_ob, stride_oh, stride_cb,
                   BLOCK: tl.constexpr, PAD_BLOCK: tl.constexpr, W: tl.constexpr, FIRST: tl.constexpr):
    NBINS: tl.constexpr = 1 << W
    b = tl.program_id(0)
    h = tl.program_id(1)
    e_lo = tl.load(cu_ptr + b)
    e_hi = tl.load(cu_ptr + b + 1)
    n = tl.maximum(e_hi - e_lo - 1, 0)  # the others: every entry but the last
    row = scores_ptr + h
    out_row = sel_ptr + b.to(tl.int64) * stride_ob + h * stride_oh
    key, ok = _keys(row, e_lo, n, stride_se, BLOCK)  # the row, or its first tile
    n_ok = tl.sum(ok.to(tl.int32), axis=0)
    for t in range(BLOCK, n, BLOCK):
        _, ok_t = _keys(row, e_lo + t, n - t, stride_se, BLOCK)
        n_ok += tl.sum(ok_t.to(tl.int32), axis=0)
    m = tl.minimum(budget - 1, n_ok)
    # the bucket: keys whose top r bits are prefix, of which the first `need` are taken. m = n_ok: every key is
    # above INT32_MIN (no selectable key has it); m = 0: none is above INT32_MAX (a NaN's key, never selectable)
    r = tl.full([], 32, tl.int32)
    prefix = tl.where(m == 0, INT32_MAX, INT32_MIN)
    need = tl.zeros([], tl.int32)
    if (m > 0) & (m < n_ok):
        hist = _histogram(key, ok, row, e_lo, n, stride_se, prefix, r, True, FIRST, W, BLOCK)
        d, above, at = _pick(hist, m, NBINS)
        need = m - above
        prefix = d - (1 << (FIRST - 1))
        r = tl.full([], FIRST, tl.int32)
        while (r < 32) & (at != need):  # at == need: the whole bucket is taken, its order no longer matters
            hist = _histogram(key, ok, row, e_lo, n, stride_se, prefix, r, False, FIRST, W, BLOCK)
            d, above, at = _pick(hist, need, NBINS)
            need -= above
            prefix = prefix * NBINS + d
            r += W
    written = tl.zeros([], tl.int32)
    eq_seen = tl.zeros([], tl.int32)
    eq_seen, written = _emit(key, ok, e_lo, r, prefix, need, eq_seen, written, out_row, BLOCK)
    for t in range(BLOCK, n, BLOCK):
        key_t, ok_t = _keys(row, e_lo + t, n - t, stride_se, BLOCK)
        eq_seen, written = _emit(key_t, ok_t, e_lo + t, r, prefix, need, eq_seen, written, out_row, BLOCK)
    if e_hi > e_lo:
        if tl.load(row + (e_hi - 1).to(tl.int64) * stride_se) > float("-inf"):
            tl.store(out_row + written, e_hi - 1)
            written += 1
    tl.store(cnt_ptr + b * stride_cb + h, written)
    for p in range((written // PAD_BLOCK) * PAD_BLOCK, budget, PAD_BLOCK):
        k = p + tl.arange(0, PAD_BLOCK)
        tl.store(out_row + k, tl.full([PAD_BLOCK], -1, tl.int32), mask=(k >= written) & (k < budget))


def launch(scores: torch.Tensor, cu_entries: torch.Tensor, budget_pages: int, max_block: int = MAX_BLOCK,
           radix_bits: int = RADIX_BITS, num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """scores fp32 [E, Hkv] (contiguous), cu_entries int32 [B+1] -> (sel int32 [B, Hkv, K], count int32 [B, Hkv]).
    Rows longer than the tile (at most max_block entries, a power of two) take the tiled path (tests lower it to
    reach that path); radix_bits and num_warps: benchmark sweeps."""
    n_entries, hkv = scores.shape
    n_seqs = cu_entries.numel() - 1
    sel = torch.empty((n_seqs, hkv, budget_pages), dtype=torch.int32, device=scores.device)
    count = torch.empty((n_seqs, hkv), dtype=torch.int32, device=scores.device)
    if n_seqs:
        # NOTE: the tile fits the table's mean row, not its longest (no host sync to know that): a batch of equal
        # rows keeps them in registers, and a single long row takes the tiled path rather than every row paying
        # for a tile of the whole table (4x the passes' work at 4 sequences)
        block = min(max_block, triton.next_power_of_2(max(16, triton.cdiv(n_entries, n_seqs))))
        first = 32 - radix_bits * ((32 - 1) // radix_bits)
        _select_kernel[(n_seqs, hkv)](
            scores, cu_entries, sel, count, budget_pages,
            scores.stride(0), sel.stride(0), sel.stride(1), count.stride(0),
            BLOCK=block, PAD_BLOCK=PAD_BLOCK, W=radix_bits, FIRST=first,
            num_warps=num_warps or max(1, min(16, block // 512)))
    return sel, count
