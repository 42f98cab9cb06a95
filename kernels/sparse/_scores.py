"""Triton page scores (Quest's bound) with deferred rotation.

One program per (BLOCK_E entries, KV head). Each entry finds its sequence by bisection over cu_entries (no host
sync, no per-entry sequence table), gathers that sequence's query heads of the KV head, rotates them BACKWARDS
by the entry's offset (fp32: cos/sin of offset * inv_freq, as the decode kernel), and takes
    max over g of Σ_i max(q'_gi · kmax_i, q'_gi · kmin_i)
on the half-split layout (rotate-half RoPE): the two halves of D are loaded and rotated as [BLOCK_E, D/2] tiles.
An entry whose mask shows no slot scores -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# entries per program and warps: [32, D/2] fp32 tiles of the query, cos/sin and bounds fit 8 warps' registers at
# D = 128 (122 a thread with G = 4 compiled for sm_90 by Triton 3.6; 4 warps need 231)
BLOCK_E = 32
NUM_WARPS = 8


@triton.jit
def _scores_kernel(q_ptr, kmin_ptr, kmax_ptr, ids_ptr, off_ptr, mask_ptr, cu_ptr, invf_ptr, out_ptr,
                   n_entries, n_seqs, search_steps,
                   stride_qb, stride_qh, stride_mb, stride_mh,
                   G: tl.constexpr, D2: tl.constexpr, BLOCK_E: tl.constexpr):
    h = tl.program_id(1)
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
    off = tl.load(off_ptr + e, mask=ok, other=0).to(tl.float32)
    ang = off[:, None] * tl.load(invf_ptr + d)[None, :]                      # [BLOCK_E, D2]
    cos = tl.cos(ang)
    sin = tl.sin(ang)
    blk = tl.load(ids_ptr + e, mask=ok, other=0).to(tl.int64)
    m_row = blk[:, None] * stride_mb + h * stride_mh + d[None, :]
    hi1 = tl.load(kmax_ptr + m_row, mask=ok[:, None], other=0.0).to(tl.float32)
    hi2 = tl.load(kmax_ptr + m_row + D2, mask=ok[:, None], other=0.0).to(tl.float32)
    lo1 = tl.load(kmin_ptr + m_row, mask=ok[:, None], other=0.0).to(tl.float32)
    lo2 = tl.load(kmin_ptr + m_row + D2, mask=ok[:, None], other=0.0).to(tl.float32)
    best = tl.full([BLOCK_E], float("-inf"), tl.float32)
    q_seq = q_ptr + lo.to(tl.int64)[:, None] * stride_qb + d[None, :]
    for g in tl.static_range(G):
        q_row = q_seq + (h * G + g) * stride_qh
        q1 = tl.load(q_row, mask=ok[:, None], other=0.0).to(tl.float32)
        q2 = tl.load(q_row + D2, mask=ok[:, None], other=0.0).to(tl.float32)
        r1 = q1 * cos + q2 * sin                                             # R_{-o} q
        r2 = q2 * cos - q1 * sin
        bound = tl.maximum(r1 * hi1, r1 * lo1) + tl.maximum(r2 * hi2, r2 * lo2)
        best = tl.maximum(best, tl.sum(bound, axis=1))
    shown = tl.load(mask_ptr + e, mask=ok, other=0) != 0
    tl.store(out_ptr + e * tl.num_programs(1) + h, tl.where(shown, best, float("-inf")), mask=ok)


def launch(q, kmin, kmax, block_ids, offsets, masks, cu_entries, inv_freq) -> torch.Tensor:
    """Inputs checked by triton.py (index tensors contiguous int32, masks int64, inv_freq fp32). -> fp32 [E, Hkv]."""
    n_entries = block_ids.numel()
    n_seqs, hq, dim = q.shape
    hkv = kmax.shape[1]
    out = torch.empty((n_entries, hkv), dtype=torch.float32, device=q.device)
    if n_entries and n_seqs:
        _scores_kernel[(triton.cdiv(n_entries, BLOCK_E), hkv)](
            q, kmin, kmax, block_ids, offsets, masks, cu_entries, inv_freq, out,
            n_entries, n_seqs, max(1, n_seqs - 1).bit_length(),
            q.stride(0), q.stride(1), kmax.stride(0), kmax.stride(1),
            G=hq // hkv, D2=dim // 2, BLOCK_E=BLOCK_E, num_warps=NUM_WARPS)
    return out
