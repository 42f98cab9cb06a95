"""Triton page scores (Quest's bound) with deferred rotation.

One program per (BLOCK_E entries, HB KV heads; by default every head, so that cos / sin of an entry's offset are
evaluated once, not once per head: they were most of the kernel's work). Each entry finds its sequence by bisection
over cu_entries (no host sync, no per-entry sequence table), gathers that sequence's query heads of each KV head,
rotates them BACKWARDS by the entry's offset (fp32: cos/sin of offset * inv_freq, as the decode kernel), and takes
    max over g of Σ_i max(q'_gi · kmax_i, q'_gi · kmin_i)
on the half-split layout (rotate-half RoPE): the two halves of D are loaded and rotated as [BLOCK_E, HB, D/2] tiles,
every head's bounds requested at once. A program whose entries are all of one sequence at one offset (pages of one
chunk: nearly every program) loads and rotates its query heads once, not once an entry. An entry whose mask shows no
slot scores -inf. Scores are stored head-major
([Hkv, E], returned as its [E, Hkv] view): a selection row is then one contiguous read, not a 32-byte stride.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

INT32_MAX = tl.constexpr(2147483647)


@dataclass(frozen=True, slots=True)
class ScoresConfig:
    """Launch shape: a program scores `tile` (entry, KV head) pairs, all the KV heads up to max_heads (each a power
    of two) of tile // heads entries; num_warps."""

    tile: int = 32
    max_heads: int = 8
    num_warps: int = 4
    one_query: bool = True   # a program of one sequence's entries at one offset rotates its query heads once

    def __post_init__(self):
        for name in ("tile", "max_heads"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")


@triton.jit
def _bound(q1, q2, cos, sin, hi1, hi2, lo1, lo2):
    """One query head's bound [BLOCK_E, HB] from its halves (rotated here backwards by each entry's offset)."""
    r1 = q1 * cos + q2 * sin                                             # R_{-o} q
    r2 = q2 * cos - q1 * sin
    bound = tl.maximum(r1 * hi1.to(tl.float32), r1 * lo1.to(tl.float32)) + \
        tl.maximum(r2 * hi2.to(tl.float32), r2 * lo2.to(tl.float32))
    return tl.sum(bound, axis=2)


@triton.jit
def _best(q_seq, h, q_ok, cos, sin, stride_qh, hi1, hi2, lo1, lo2, G: tl.constexpr, D2: tl.constexpr,
          BLOCK_E: tl.constexpr, HB: tl.constexpr):
    """Max over the group heads of the bound [BLOCK_E, HB]; q_seq points at the query rows of the entries' sequence
    ([1, 1, D2] for one sequence, [BLOCK_E, 1, D2] for an entry each), rotated by cos / sin of the same shapes."""
    best = tl.full([BLOCK_E, HB], float("-inf"), tl.float32)
    for g in tl.static_range(G):
        q_row = q_seq + (h * G + g)[None, :, None] * stride_qh
        q1 = tl.load(q_row, mask=q_ok, other=0.0).to(tl.float32)
        q2 = tl.load(q_row + D2, mask=q_ok, other=0.0).to(tl.float32)
        best = tl.maximum(best, _bound(q1, q2, cos, sin, hi1, hi2, lo1, lo2))
    return best


@triton.jit
def _best_one(q_ptr, seq, off, invf, h, n_heads, d, stride_qb, stride_qh, hi1, hi2, lo1, lo2,
              G: tl.constexpr, D2: tl.constexpr, BLOCK_E: tl.constexpr, HB: tl.constexpr):
    """``_best`` of entries that are all of sequence ``seq`` at offset ``off``: the query heads loaded and rotated
    once."""
    ang = off.to(tl.float32) * invf
    return _best(q_ptr + seq.to(tl.int64) * stride_qb + d[None, None, :], h, (h < n_heads)[None, :, None],
                 tl.cos(ang)[None, None, :], tl.sin(ang)[None, None, :], stride_qh, hi1, hi2, lo1, lo2,
                 G, D2, BLOCK_E, HB)


@triton.jit
def _best_each(q_ptr, seq, off, invf, h, d, ok3, stride_qb, stride_qh, hi1, hi2, lo1, lo2,
               G: tl.constexpr, D2: tl.constexpr, BLOCK_E: tl.constexpr, HB: tl.constexpr):
    """``_best``, each entry with its own sequence seq [BLOCK_E] and offset off [BLOCK_E]."""
    ang = off.to(tl.float32)[:, None] * invf[None, :]                     # [BLOCK_E, D2]
    return _best(q_ptr + seq.to(tl.int64)[:, None, None] * stride_qb + d[None, None, :], h, ok3,
                 tl.cos(ang)[:, None, :], tl.sin(ang)[:, None, :], stride_qh, hi1, hi2, lo1, lo2,
                 G, D2, BLOCK_E, HB)


@triton.jit
def _scores_kernel(q_ptr, kmin_ptr, kmax_ptr, ids_ptr, off_ptr, mask_ptr, cu_ptr, invf_ptr, out_ptr,
                   n_entries, n_seqs, n_heads, search_steps,
                   stride_qb, stride_qh, stride_mb, stride_mh,
                   G: tl.constexpr, D2: tl.constexpr, BLOCK_E: tl.constexpr, HB: tl.constexpr,
                   ONE_QUERY: tl.constexpr):
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
    off = tl.load(off_ptr + e, mask=ok, other=0).to(tl.int32)
    invf = tl.load(invf_ptr + d)
    first = tl.min(tl.where(ok, lo, n_seqs), axis=0)
    off_first = tl.min(tl.where(ok, off, INT32_MAX), axis=0)
    if ONE_QUERY & (first == tl.max(tl.where(ok, lo, -1), axis=0)) & (off_first == tl.max(tl.where(ok, off, -1), axis=0)):
        # every entry of one sequence at one offset (pages of one chunk): its query heads loaded and rotated once,
        # [1, HB, D2], not once an entry
        best = _best_one(q_ptr, first, off_first, invf, h, n_heads, d, stride_qb, stride_qh, hi1, hi2, lo1, lo2,
                         G, D2, BLOCK_E, HB)
    else:
        best = _best_each(q_ptr, lo, off, invf, h, d, ok3, stride_qb, stride_qh, hi1, hi2, lo1, lo2,
                          G, D2, BLOCK_E, HB)
    shown = tl.load(mask_ptr + e, mask=ok, other=0) != 0
    # head-major [Hkv, E]: the selection reads a (sequence, head) row contiguously
    tl.store(out_ptr + h[None, :].to(tl.int64) * n_entries + e[:, None], tl.where(shown[:, None], best, float("-inf")),
             mask=ok2)


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
            G=hq // hkv, D2=dim // 2, BLOCK_E=block_e, HB=heads, ONE_QUERY=cfg.one_query, num_warps=cfg.num_warps)
    return out.t()
