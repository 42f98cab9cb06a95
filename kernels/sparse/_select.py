"""Triton page selection: per (sequence, KV head), the last entry and the top (budget - 1) of the others.

One program per (sequence, KV head). Each fp32 score becomes an order-preserving signed 32-bit key (every bit but the
sign flipped for negatives). The m-th largest key among the row's selectable others (m = budget - 1, or fewer when
fewer are selectable) is found by a radix select from the top: the bucket is the keys whose top r bits are a prefix,
and each pass takes a histogram (tl.histogram) of the next RADIX_BITS bits of the keys in it; the digit where the
count from the top reaches the number still needed narrows it. It starts below the bits every selectable key shares
(those of its smallest and largest key: the sign and most of the exponent of a row of scores), and stops as soon as
the bucket holds exactly as many keys as are still needed (distinct scores: after a few passes) or at the last bit.
32 one-bit counting passes were the previous kernel; a pass costs a few barriers of the program's warps, so the
number of passes is the kernel's latency. A pass's bookkeeping is one scan and one three-way reduction.

Then, in index order, every key above the bucket is taken and the first (needed) keys in it (ties broken by the
lowest entry): exactly m entries, each written at (keys above it) + min(bucket keys before it, needed), ascending;
the last entry after them; -1 past.

Rows are read with any strides (page_scores stores them head-major: a row is contiguous). A row of up to BLOCK
entries stays in registers for all its passes; a longer row re-reads its scores every pass, tile by tile (the launcher
sizes BLOCK by the table's mean row, so one long row of a batch takes that path). -inf (a page with no visible slot)
and NaN are never selected.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 8192  # row entries kept in registers: 8 warps hold 32 int32 keys a thread
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
def _stats_combine(n_a, lo_a, hi_a, n_b, lo_b, hi_b):
    return n_a + n_b, tl.minimum(lo_a, lo_b), tl.maximum(hi_a, hi_b)


@triton.jit
def _stats(key, ok):
    """(selectable keys, their smallest, their largest) in one reduction."""
    return tl.reduce((ok.to(tl.int32), tl.where(ok, key, INT32_MAX), tl.where(ok, key, INT32_MIN)), 0,
                     _stats_combine)


@triton.jit
def _add3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _lz_step(x, n, W: tl.constexpr):
    top_zero = (x >> (32 - W)) == 0
    return tl.where(top_zero, x << W, x), tl.where(top_zero, n + W, n)


@triton.jit
def _leading_zeros(x):
    """Leading zero bits of a non-negative int32 scalar (32 for 0)."""
    n = tl.zeros([], tl.int32)
    x, n = _lz_step(x, n, 16)
    x, n = _lz_step(x, n, 8)
    x, n = _lz_step(x, n, 4)
    x, n = _lz_step(x, n, 2)
    x, n = _lz_step(x, n, 1)
    return tl.where(x >= 0, n + 1, n)


@triton.jit
def _digits(key, ok, prefix, r, w, FIRST_PASS: tl.constexpr, FIRST: tl.constexpr):
    """This pass's digit of each key and whether the key is in the bucket (its top r bits == prefix; r >= 1). The
    first pass over keys of both signs: the top FIRST bits, sign included, shifted to start at 0."""
    if FIRST_PASS:
        dig = (key >> (32 - FIRST)) + (1 << (FIRST - 1))
        inb = ok
    else:
        dig = (key >> (32 - r - w)) & ((1 << w) - 1)
        inb = ok & ((key >> (32 - r)) == prefix)
    return dig, inb


@triton.jit
def _histogram(key, ok, row, e_lo, n, stride_e, prefix, r, w,
               FIRST_PASS: tl.constexpr, FIRST: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr):
    """Histogram [2**W] of the bucket's digits over the row: its first tile from registers, the rest (a row longer
    than BLOCK) re-read tile by tile."""
    dig, inb = _digits(key, ok, prefix, r, w, FIRST_PASS, FIRST)
    hist = tl.histogram(dig, 1 << W, mask=inb)
    for t in range(BLOCK, n, BLOCK):
        key_t, ok_t = _keys(row, e_lo + t, n - t, stride_e, BLOCK)
        dig, inb = _digits(key_t, ok_t, prefix, r, w, FIRST_PASS, FIRST)
        hist += tl.histogram(dig, 1 << W, mask=inb)
    return hist


@triton.jit
def _pick(hist, in_bucket, need):
    """Histogram of the bucket's digits (in_bucket keys in all) -> (the largest digit d with count(digit >= d) >=
    need, the count above d, the count at d)."""
    from_top = in_bucket - tl.cumsum(hist, axis=0) + hist  # count(digit >= t), non-increasing
    ge = from_top >= need
    n_ge, above, at = tl.reduce((ge.to(tl.int32), tl.where(ge, 0, hist), tl.where(ge & (from_top - hist < need), hist, 0)),
                                0, _add3)
    return n_ge - 1, above, at


@triton.jit
def _emit(key, ok, first, r, prefix, need, above_seen, eq_seen, out_row, BLOCK: tl.constexpr):
    """Write the tile's selected entries (global indices first + i): the keys above the bucket (top r bits > prefix)
    and the first `need` in it, each at (keys above it) + min(bucket keys before it, need), counting those met in
    earlier tiles. -> the running counts."""
    top = key >> (32 - r)
    above = ok & (top > prefix)
    eq = ok & (top == prefix)
    above_rank, eq_rank = tl.associative_scan((above.to(tl.int32), eq.to(tl.int32)), 0, _add2)
    above_rank += above_seen - above.to(tl.int32)   # exclusive ranks
    eq_rank += eq_seen - eq.to(tl.int32)
    take = above | (eq & (eq_rank < need))
    tl.store(out_row + above_rank + tl.minimum(eq_rank, need), (first + tl.arange(0, BLOCK)).to(tl.int32), mask=take)
    n_above, n_eq = tl.reduce((above.to(tl.int32), eq.to(tl.int32)), 0, _add2)
    return above_seen + n_above, eq_seen + n_eq


@triton.jit
def _select_kernel(scores_ptr, cu_ptr, sel_ptr, cnt_ptr, budget,
                   stride_se, stride_sh, stride_ob, stride_oh, stride_cb,
                   BLOCK: tl.constexpr, PAD_BLOCK: tl.constexpr, W: tl.constexpr, FIRST: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    e_lo = tl.load(cu_ptr + b)
    e_hi = tl.load(cu_ptr + b + 1)
    n = tl.maximum(e_hi - e_lo - 1, 0)  # the others: every entry but the last
    row = scores_ptr + h * stride_sh
    out_row = sel_ptr + b.to(tl.int64) * stride_ob + h * stride_oh
    key, ok = _keys(row, e_lo, n, stride_se, BLOCK)  # the row, or its first tile
    n_ok, k_lo, k_hi = _stats(key, ok)
    for t in range(BLOCK, n, BLOCK):
        key_t, ok_t = _keys(row, e_lo + t, n - t, stride_se, BLOCK)
        n_t, lo_t, hi_t = _stats(key_t, ok_t)
        n_ok, k_lo, k_hi = _stats_combine(n_ok, k_lo, k_hi, n_t, lo_t, hi_t)
    last_ok = tl.load(row + (e_hi - 1).to(tl.int64) * stride_se, mask=e_hi > e_lo, other=float("-inf")) > float("-inf")
    m = tl.minimum(budget - 1, n_ok)
    # the bucket: keys whose top r bits are prefix, of which the first `need` are taken. m = n_ok: every key is
    # above INT32_MIN (no selectable key has it); m = 0: none is above INT32_MAX (a NaN's key, never selectable)
    r = tl.full([], 32, tl.int32)
    prefix = tl.where(m == 0, INT32_MAX, INT32_MIN)
    need = tl.zeros([], tl.int32)
    if (m > 0) & (m < n_ok):
        # the top bits every selectable key shares (none when signs differ): the search starts below them
        r = tl.where((k_lo ^ k_hi) < 0, 0, _leading_zeros(k_lo ^ k_hi))
        prefix = k_lo >> (32 - tl.maximum(r, 1))
        need = m
        at = n_ok
        if r == 0:
            hist = _histogram(key, ok, row, e_lo, n, stride_se, prefix, r, W, True, FIRST, W, BLOCK)
            d, above, at = _pick(hist, n_ok, need)
            need -= above
            prefix = d - (1 << (FIRST - 1))
            r = tl.full([], FIRST, tl.int32)
        while (r < 32) & (at != need):  # at == need: the whole bucket is taken, its order no longer matters
            w = tl.minimum(32 - r, W)
            hist = _histogram(key, ok, row, e_lo, n, stride_se, prefix, r, w, False, FIRST, W, BLOCK)
            d, above, at = _pick(hist, at, need)
            need -= above
            prefix = prefix * (1 << w) + d
            r += w
    above_seen = tl.zeros([], tl.int32)
    eq_seen = tl.zeros([], tl.int32)
    above_seen, eq_seen = _emit(key, ok, e_lo, r, prefix, need, above_seen, eq_seen, out_row, BLOCK)
    for t in range(BLOCK, n, BLOCK):
        key_t, ok_t = _keys(row, e_lo + t, n - t, stride_se, BLOCK)
        above_seen, eq_seen = _emit(key_t, ok_t, e_lo + t, r, prefix, need, above_seen, eq_seen, out_row, BLOCK)
    written = above_seen + tl.minimum(eq_seen, need)
    if last_ok:
        tl.store(out_row + written, e_hi - 1)
        written += 1
    tl.store(cnt_ptr + b * stride_cb + h, written)
    for p in range((written // PAD_BLOCK) * PAD_BLOCK, budget, PAD_BLOCK):
        k = p + tl.arange(0, PAD_BLOCK)
        tl.store(out_row + k, tl.full([PAD_BLOCK], -1, tl.int32), mask=(k >= written) & (k < budget))


def launch(scores: torch.Tensor, cu_entries: torch.Tensor, budget_pages: int, max_block: int = MAX_BLOCK,
           radix_bits: int = RADIX_BITS, num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """scores fp32 [E, Hkv] (any strides), cu_entries int32 [B+1] -> (sel int32 [B, Hkv, K], count int32 [B, Hkv]).
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
        # 8 warps: 11.2 -> 9.8 us at 2,048 entries, 25.7 (16 warps) -> 22.4 at 8,192 (H100, bench/decode/sparse_kernels.py)
        _select_kernel[(n_seqs, hkv)](
            scores, cu_entries, sel, count, budget_pages,
            scores.stride(0), scores.stride(1), sel.stride(0), sel.stride(1), count.stride(0),
            BLOCK=block, PAD_BLOCK=PAD_BLOCK, W=radix_bits, FIRST=first,
            num_warps=num_warps or max(2, min(8, block // 256)))
    return sel, count
