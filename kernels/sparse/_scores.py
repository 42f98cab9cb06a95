"""Triton page scores (Quest's bound) with deferred rotation.

One program per (BLOCK_E entries, HB KV heads; by default every head, so that cos / sin of an entry's offset are
evaluated once, not once per head: they were most of the kernel's work). Each entry finds its sequence by bisection
over cu_entries (no host sync, no per-entry sequence table), gathers that sequence's query heads of each KV head,
rotates them BACKWARDS by the entry's offset (fp32: cos/sin of offset * inv_freq, as the decode kernel), and takes
    max over g of Σ_i max(q'_gi · kmax_i, q'_gi · kmin_i)
on the half-split layout (rotate-half RoPE): the two halves of D are loaded and rotated as [BLOCK_E, HB, D/2] tiles,
every head's bounds requested at once. An entry whose mask shows no slot scores -inf. Scores are stored head-major
([Hkv, E], returned as its [E, Hkv] view): a selection row is then one contiguous read, not a 32-byte stride.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.sparse import _select
from kernels.sparse._select import select_row


@dataclass(frozen=True, slots=True)
class ScoresConfig:
    """Launch shape: a program scores `tile` (entry, KV head) pairs, all the KV heads up to max_heads (each a power
    of two) of tile // heads entries; num_warps."""

    tile: int = 32
    max_heads: int = 8
    num_warps: int = 4

    def __post_init__(self):
        for name in ("tile", "max_heads"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")


# the fused launch: one KV head a program (the row's last tile selects each of its program's heads in turn, so a
# program of every head would select them one after another), 8 warps as the selection
FUSED = ScoresConfig(tile=32, max_heads=1, num_warps=8)


@triton.jit
def _score_tile(q_ptr, kmin_ptr, kmax_ptr, ids_ptr, off_ptr, mask_ptr, cu_ptr, invf_ptr, out_ptr,
                n_entries, n_seqs, n_heads, search_steps,
                stride_qb, stride_qh, stride_mb, stride_mh,
                G: tl.constexpr, D2: tl.constexpr, BLOCK_E: tl.constexpr, HB: tl.constexpr):
    """The scores of this program's BLOCK_E entries and HB KV heads, stored head-major."""
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    ok = e < n_entries
    # the entry's sequence: the largest b with cu[b] <= e (an empty sequence before it shares its bound)
    lo = tl.zeros([BLOCK_E], tl.int32)
    hi = tl.zeros([BLOCK_E], tl.int32) + (n_seqs - 1)
    for _ in range(search_steps):
        mid = (lo + hi + 1) // 2
        below = tl.load(cu_ptr + mid) <= e
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid - 1)
    d = tl.arange(0, D2)
    h = tl.program_id(1) * HB + tl.arange(0, HB)
    ok2 = ok[:, None] & (h < n_heads)[None, :]                                # [BLOCK_E, HB]
    ok3 = ok2[:, :, None]
    blk = tl.load(ids_ptr + e, mask=ok, other=0).to(tl.int64)
    # every head's bounds requested at once (a loop over heads waited for each head's in turn): [BLOCK_E, HB, D2]
    m_row = blk[:, None, None] * stride_mb + h[None, :, None] * stride_mh + d[None, None, :]
    hi1 = tl.load(kmax_ptr + m_row, mask=ok3, other=0.0)
    hi2 = tl.load(kmax_ptr + m_row + D2, mask=ok3, other=0.0)
    lo1 = tl.load(kmin_ptr + m_row, mask=ok3, other=0.0)
    lo2 = tl.load(kmin_ptr + m_row + D2, mask=ok3, other=0.0)
    off = tl.load(off_ptr + e, mask=ok, other=0).to(tl.float32)
    ang = off[:, None] * tl.load(invf_ptr + d)[None, :]                      # [BLOCK_E, D2]
    cos = tl.cos(ang)[:, None, :]
    sin = tl.sin(ang)[:, None, :]
    q_seq = q_ptr + lo.to(tl.int64)[:, None, None] * stride_qb + d[None, None, :]
    best = tl.full([BLOCK_E, HB], float("-inf"), tl.float32)
    for g in tl.static_range(G):
        q_row = q_seq + (h * G + g)[None, :, None] * stride_qh
        q1 = tl.load(q_row, mask=ok3, other=0.0).to(tl.float32)
        q2 = tl.load(q_row + D2, mask=ok3, other=0.0).to(tl.float32)
        r1 = q1 * cos + q2 * sin                                             # R_{-o} q
        r2 = q2 * cos - q1 * sin
        bound = tl.maximum(r1 * hi1.to(tl.float32), r1 * lo1.to(tl.float32)) + \
            tl.maximum(r2 * hi2.to(tl.float32), r2 * lo2.to(tl.float32))
        best = tl.maximum(best, tl.sum(bound, axis=2))
    shown = tl.load(mask_ptr + e, mask=ok, other=0) != 0
    # head-major [Hkv, E]: the selection reads a (sequence, head) row contiguously
    tl.store(out_ptr + h[None, :].to(tl.int64) * n_entries + e[:, None], tl.where(shown[:, None], best, float("-inf")),
             mask=ok2)


@triton.jit
def _scores_kernel(q_ptr, kmin_ptr, kmax_ptr, ids_ptr, off_ptr, mask_ptr, cu_ptr, invf_ptr, out_ptr,
                   n_entries, n_seqs, n_heads, search_steps,
                   stride_qb, stride_qh, stride_mb, stride_mh,
                   G: tl.constexpr, D2: tl.constexpr, BLOCK_E: tl.constexpr, HB: tl.constexpr):
    _score_tile(q_ptr, kmin_ptr, kmax_ptr, ids_ptr, off_ptr, mask_ptr, cu_ptr, invf_ptr, out_ptr,
                n_entries, n_seqs, n_heads, search_steps, stride_qb, stride_qh, stride_mb, stride_mh,
                G, D2, BLOCK_E, HB)


@triton.jit
def _anchor(cu_ptr, b, n_entries):
    """Sequence b's entries [lo, hi) as the tiles count them: an empty sequence stands on the entry where it would
    start (the last one past the end), so that one tile selects for it too."""
    lo = tl.minimum(tl.load(cu_ptr + b), n_entries - 1)
    return lo, tl.maximum(tl.load(cu_ptr + b + 1), lo + 1)


@triton.jit
def _score_select_kernel(q_ptr, kmin_ptr, kmax_ptr, ids_ptr, off_ptr, mask_ptr, cu_ptr, invf_ptr, out_ptr,
                         sel_ptr, cnt_ptr, arrived_ptr, budget,
                         n_entries, n_seqs, n_heads, search_steps,
                         stride_qb, stride_qh, stride_mb, stride_mh, stride_ob, stride_oh, stride_cb,
                         G: tl.constexpr, D2: tl.constexpr, BLOCK_E: tl.constexpr, HB: tl.constexpr,
                         BLOCK: tl.constexpr, PAD_BLOCK: tl.constexpr, W: tl.constexpr, FIRST: tl.constexpr):
    _score_tile(q_ptr, kmin_ptr, kmax_ptr, ids_ptr, off_ptr, mask_ptr, cu_ptr, invf_ptr, out_ptr,
                n_entries, n_seqs, n_heads, search_steps, stride_qb, stride_qh, stride_mb, stride_mh,
                G, D2, BLOCK_E, HB)
    tl.debug_barrier()   # every warp's scores stored before the arrival (whose release publishes them)
    start = tl.program_id(0) * BLOCK_E
    end = tl.minimum(start + BLOCK_E, n_entries)
    # the sequences whose anchors meet this tile, b0 .. b1 (anchors are non-decreasing in b)
    b0 = tl.zeros([], tl.int32)
    hi = tl.zeros([], tl.int32) + (n_seqs - 1)
    for _ in range(search_steps):   # the first b with anchor end > start
        mid = (b0 + hi) // 2
        _, a_hi = _anchor(cu_ptr, mid, n_entries)
        go = a_hi > start
        hi = tl.where(go, mid, hi)
        b0 = tl.where(go, b0, mid + 1)
    lo = tl.zeros([], tl.int32)
    b1 = tl.zeros([], tl.int32) + (n_seqs - 1)
    for _ in range(search_steps):   # the last b with anchor start < end
        mid = (lo + b1 + 1) // 2
        a_lo, _ = _anchor(cu_ptr, mid, n_entries)
        go = a_lo < end
        lo = tl.where(go, mid, lo)
        b1 = tl.where(go, b1, mid - 1)
    for b_it in range(b0, b1 + 1):
        b = b_it + tl.zeros([], tl.int32)   # a tensor (the interpreter's loop gives ints)
        a_lo, a_hi = _anchor(cu_ptr, b, n_entries)
        tiles = (a_hi - 1) // BLOCK_E - a_lo // BLOCK_E + 1
        # acq_rel: the last of the row's tiles to arrive sees every other tile's scores
        if tl.atomic_add(arrived_ptr + b * tl.num_programs(1) + tl.program_id(1), 1) == tiles - 1:
            for hh in range(HB):
                h = tl.program_id(1) * HB + hh
                if h < n_heads:
                    select_row(out_ptr, cu_ptr, sel_ptr, cnt_ptr, budget, b, h, 1, n_entries,
                               stride_ob, stride_oh, stride_cb, BLOCK, PAD_BLOCK, W, FIRST)


def launch(q, kmin, kmax, block_ids, offsets, masks, cu_entries, inv_freq,
           cfg: ScoresConfig = ScoresConfig()) -> torch.Tensor:
    """Inputs checked by triton.py (contiguous ids and offsets int32 or int64, masks int64, cu int32, inv_freq fp32).
    -> fp32 [E, Hkv], a view of [Hkv, E] storage."""
    n_entries = block_ids.numel()
    n_seqs, hq, dim = q.shape
    hkv = kmax.shape[1]
    heads = min(triton.next_power_of_2(hkv), cfg.max_heads)
    block_e = max(1, cfg.tile // heads)
    out = torch.empty((hkv, n_entries), dtype=torch.float32, device=q.device)
    if n_entries and n_seqs:
        _scores_kernel[(triton.cdiv(n_entries, block_e), triton.cdiv(hkv, heads))](
            q, kmin, kmax, block_ids, offsets, masks, cu_entries, inv_freq, out,
            n_entries, n_seqs, hkv, max(1, n_seqs - 1).bit_length(),
            q.stride(0), q.stride(1), kmax.stride(0), kmax.stride(1),
            G=hq // hkv, D2=dim // 2, BLOCK_E=block_e, HB=heads, num_warps=cfg.num_warps)
    return out.t()


def launch_with_selection(q, kmin, kmax, block_ids, offsets, masks, cu_entries, inv_freq, budget_pages: int,
                          cfg: ScoresConfig = FUSED) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scores and the selection in one launch: each (sequence, head group) row's tiles count their arrivals, and the
    last to arrive selects the row's heads (_select.select_row). -> (scores fp32 [E, Hkv], sel int32 [B, Hkv, K],
    count int32 [B, Hkv]). The arrival counters are zeroed in the same stream (a memset a call: a captured graph
    replays it)."""
    n_entries = block_ids.numel()
    n_seqs, hq, dim = q.shape
    hkv = kmax.shape[1]
    if not n_entries:   # no tile to select: every row is empty
        out = torch.empty((hkv, 0), dtype=torch.float32, device=q.device).t()
        return (out, *_select.launch(out, cu_entries, budget_pages))
    heads = min(triton.next_power_of_2(hkv), cfg.max_heads)
    block_e = max(1, cfg.tile // heads)
    groups = triton.cdiv(hkv, heads)
    out = torch.empty((hkv, n_entries), dtype=torch.float32, device=q.device)
    sel = torch.empty((n_seqs, hkv, budget_pages), dtype=torch.int32, device=q.device)
    count = torch.empty((n_seqs, hkv), dtype=torch.int32, device=q.device)
    arrived = torch.zeros(n_seqs * groups, dtype=torch.int32, device=q.device)
    _score_select_kernel[(triton.cdiv(n_entries, block_e), groups)](
        q, kmin, kmax, block_ids, offsets, masks, cu_entries, inv_freq, out, sel, count, arrived, budget_pages,
        n_entries, n_seqs, hkv, max(1, n_seqs - 1).bit_length(),
        q.stride(0), q.stride(1), kmax.stride(0), kmax.stride(1), sel.stride(0), sel.stride(1), count.stride(0),
        G=hq // hkv, D2=dim // 2, BLOCK_E=block_e, HB=heads,
        BLOCK=_select.row_block(n_entries, n_seqs), PAD_BLOCK=_select.PAD_BLOCK, W=_select.RADIX_BITS,
        FIRST=_select.first_bits(_select.RADIX_BITS), num_warps=cfg.num_warps)
    return out.t(), sel, count
