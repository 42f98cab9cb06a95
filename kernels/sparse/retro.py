"""RetroAttention's page sets and correction: for each past query, the pages this step reads that it has not seen,
and its attention corrected with them; and a Retro step's sparse layer, the current queries' sparse attention and
their past queries' correction in one read of the selected pages.

A past query (row r, of sequence seq_of[r]) is corrected with the pages its sequence's current query selected now,
``sel`` [B, Hkv, K] (``select_pages``: global entry indices, ascending, -1 past the count), that existed at its own
step (index within its sequence, sel - cu[seq_of[r]], < entries[r]) and that it has not seen (not in ``seen``
[R, Hkv, W]: indices within the sequence, -1 padded).

``new_pages`` and ``retro_attention`` are plain torch (the fused kernel's twin is made of them):
    new_pages:        those pages as a selection (global, ascending, -1 past the count) and their count;
    retro_attention:  out, lse = attention over (the pages the row had seen) ∪ (its new pages), by merging the
                      attention over the new pages with the row's prior output by log-sum-exp; count = its new pages.
``quest_retro_attention`` dispatches to its twin (the sparse attention's twin for the current rows, retro_attention
for the past ones) or its Triton kernel (``_retro.py``: one launch, two when the selection is split).
"""

from __future__ import annotations

import torch

from kernels.lse_merge.reference import merge_attention
from kernels.sparse import reference


def new_pages(sel, seq_of, entries, seen, cu):
    """sel int [B, Hkv, K], seq_of int [R], entries int [R], seen int [R, Hkv, W], cu int [B + 1] ->
    (sel int32 [R, Hkv, K], count int32 [R, Hkv])."""
    start = cu.long()[:-1][seq_of.long()][:, None, None]
    picked = sel.long()[seq_of.long()]                                       # [R, Hkv, K]
    cand = torch.where(picked >= 0, picked - start, -1)                      # within the sequence
    new = (cand >= 0) & (cand < entries.long()[:, None, None])
    if seen.shape[-1]:
        new &= ~(cand[..., None] == seen.long()[:, :, None, :]).any(-1)
    big = torch.iinfo(torch.int64).max
    order = torch.where(new, cand, big).sort(-1).values                       # the new pages first, ascending
    out = torch.where(order != big, order + start, -1).to(torch.int32)
    return out, new.sum(-1, dtype=torch.int32)


def retro_attention(q_past, k_cache, v_cache, block_ids, offsets, masks, sel, seq_of, entries, seen, cu, out_in, lse_in,
                    inv_freq, scale):
    """Past rows' attention corrected at one sparse layer. q_past [R, Hq, D] (each row's query, rotated at its own
    position), the block table and caches as kernels/sparse/reference.py lays them out; sel, seq_of, entries, seen,
    cu as ``new_pages`` takes them; out_in [R, Hq, D] (q's dtype), lse_in [R, Hq] fp32: each row's attention so far
    (0 and -inf: none). Returns out [R, Hq, D] (q's dtype), lse [R, Hq] fp32 and count int32 [R, Hkv] (the pages
    attended: ``new_pages``' count)."""
    pages, count = new_pages(sel, seq_of, entries, seen, cu)
    o_new, lse_new = reference.sparse_decode_attention(q_past, k_cache, v_cache, block_ids, offsets, masks, pages,
                                                       count, inv_freq, scale)
    out, lse = merge_attention(torch.stack([out_in, o_new]), torch.stack([lse_in, lse_new]))
    return out, lse, count


def quest_retro_attention_reference(q, q_past, k_cache, v_cache, block_ids, offsets, masks, sel, count, entries, seen,
                                    cu, out_in, lse_in, inv_freq, scale):
    """The sparse attention's twin for the current rows, then retro_attention for the past ones."""
    out, lse = reference.sparse_decode_attention(q, k_cache, v_cache, block_ids, offsets, masks, sel, count, inv_freq,
                                                 scale)
    per = q_past.shape[0] // max(q.shape[0], 1)
    seq_of = torch.arange(q_past.shape[0], device=q.device) // max(per, 1)
    out_p, lse_p, count_p = retro_attention(q_past, k_cache, v_cache, block_ids, offsets, masks, sel, seq_of,
                                            entries, seen, cu, out_in, lse_in, inv_freq, scale)
    return out, lse, out_p, lse_p, count_p


def quest_retro_attention(q, q_past, k_cache, v_cache, block_ids, offsets, masks, sel, count, entries, seen, cu, out_in,
                          lse_in, inv_freq, scale, backend: str = "torch"):
    """A RetroAttention step's sparse layer in one read of the selected pages: the current rows' attention over
    their selection (``sparse_decode_attention``) and their past rows' correction (``retro_attention``) at once.
    q [B, Hq, D] the current rows, sel / count [B, Hkv, K] / [B, Hkv] their selection; q_past [B * P, Hq, D] their
    past rows, P a row (row b's are b * P .. b * P + P - 1; a row with fewer pads the rest with inert rows: no
    entries, prior 0 and -inf), with entries, seen, out_in, lse_in as ``retro_attention`` takes them and cu [B + 1].
    On the current rows it equals ``sparse_decode_attention``, on the past rows ``retro_attention``.
    Returns out [B, Hq, D], lse [B, Hq], out_past [B * P, Hq, D], lse_past [B * P, Hq] and count_past int32
    [B * P, Hkv]. No host sync, nothing written but its outputs (a decode graph replays it)."""
    args = (q, q_past, k_cache, v_cache, block_ids, offsets, masks, sel, count, entries, seen, cu, out_in, lse_in,
            inv_freq, scale)
    if backend == "torch":
        return quest_retro_attention_reference(*args)
    if backend == "triton":
        from kernels.sparse._retro import quest_retro_attention_triton

        return quest_retro_attention_triton(*args)
    raise ValueError(f"unknown backend {backend!r} (torch or triton)")
