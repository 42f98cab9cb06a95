"""RetroAttention's page sets: for each past query, the pages this step reads that it has not seen.

A past query (row r, of sequence seq_of[r]) is corrected with the pages its sequence's current query selected now,
``sel`` [B, Hkv, K] (``select_pages``: global entry indices, ascending, -1 past the count), that existed at its own
step (index within its sequence, sel - cu[seq_of[r]], < entries[r]) and that it has not seen (not in ``seen``
[R, Hkv, W]: indices within the sequence, -1 padded). The result is the sparse attention's selection for those
rows: global entry indices, ascending, -1 past the count, and the count, as ``sparse_decode_attention`` takes them.

``new_pages`` dispatches to the plain-torch twin (``new_pages_reference``) or the Triton kernel (``_retro.py``).
"""

from __future__ import annotations

import torch


def new_pages_reference(sel, seq_of, entries, seen, cu):
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


def new_pages(sel, seq_of, entries, seen, cu, backend: str = "torch"):
    """See the module's docstring; ``backend`` "torch" (the twin) or "triton"."""
    if backend == "torch":
        return new_pages_reference(sel, seq_of, entries, seen, cu)
    if backend == "triton":
        from kernels.sparse._retro import new_pages_triton

        return new_pages_triton(sel, seq_of, entries, seen, cu)
    raise ValueError(f"unknown backend {backend!r} (torch or triton)")
