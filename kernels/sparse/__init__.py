"""Quest sparse decode: per-block key bounds (page bounds), page scores from them, a top-k page selection per
(sequence, KV head), and decode attention over the selected pages only (docs: /work/shared/DESIGN.md, "Sparse and retrieval decode").

Each function dispatches to the plain-torch twin (``reference.py``, where the layout is written down) or the
Triton kernels (``triton.py``). A decode step is
    bound_pages(k_cache, kmin, kmax, blocks, visible)                             # this step's written blocks
    scores = page_scores(q, kmin, kmax, table..., cu_entries, inv_freq)          # fp32 [E, Hkv]
    sel, count = select_pages(scores, cu_entries, budget_pages)                  # int32 [B, Hkv, K], [B, Hkv]
    out, lse = sparse_decode_attention(q, k_cache, v_cache, table..., sel, count, inv_freq, scale)
Scores and attention rotate the query backwards by each entry's offset (deferred RoPE), so a shared chunk's page
metadata, computed once in the chunk's frame, serves wherever the chunk is placed.

RetroAttention's correction of past queries at a sparse layer is ``retro_attention`` (retro.py, plain torch: the
pages a past query has not seen among those selected, attended and merged with its prior output);
``quest_retro_attention`` does it together with the current queries' sparse attention, each selected page read once
for both (a Retro step's sparse layer; a Triton kernel and its twin).
"""

from __future__ import annotations

import torch

from kernels.sparse import reference
from kernels.sparse.retro import quest_retro_attention, retro_attention

__all__ = ["bound_pages", "page_scores", "quest_retro_attention", "retro_attention", "select_pages",
           "sparse_decode_attention", "sparse_decode_parts"]


def _impl(backend: str):
    if backend == "torch":
        return reference
    if backend == "triton":
        from kernels.sparse import triton as impl

        return impl
    raise ValueError(f"unknown sparse decode backend {backend!r} (torch or triton)")


def bound_pages(k_cache: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, blocks: torch.Tensor,
                visible: torch.Tensor, backend: str = "torch") -> None:
    """In place: kmin, kmax [N, Hkv, D] (k_cache's dtype) of blocks (int [n]) = the elementwise min / max of
    k_cache [N, BS, Hkv, D] over the slots visible (bool [n, BS]) shows; a block named twice gets the bounds of the
    union of its rows' slots, a block with no visible slot +inf / -inf. No host sync (a decode graph replays it)."""
    _impl(backend).bound_pages(k_cache, kmin, kmax, blocks, visible)


def page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, block_ids: torch.Tensor,
                offsets: torch.Tensor, masks: torch.Tensor, cu_entries: torch.Tensor, inv_freq: torch.Tensor,
                backend: str = "torch") -> torch.Tensor:
    """q [B, Hq, D] (rotated at each sequence's position), page bounds kmin, kmax [N, Hkv, D] -> fp32 [E, Hkv]:
    per entry and KV head, max over its query heads of Σ_i max(q'_i·kmax_i, q'_i·kmin_i), q' = R_{-offset} q;
    -inf where the entry's mask shows no slot."""
    return _impl(backend).page_scores(q, kmin, kmax, block_ids, offsets, masks, cu_entries, inv_freq)


def select_pages(scores: torch.Tensor, cu_entries: torch.Tensor, budget_pages: int,
                 backend: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """scores fp32 [E, Hkv] -> (sel int32 [B, Hkv, budget_pages], count int32 [B, Hkv]): per sequence and KV head
    its last entry and the budget_pages - 1 highest-scoring others (all when they fit), never a -inf one, as
    global entry indices in ascending order, -1 past count. Ties: any of the tied entries."""
    if isinstance(budget_pages, bool) or not isinstance(budget_pages, int) or budget_pages < 1:
        raise ValueError(f"budget_pages must be an int >= 1, got {budget_pages!r}")
    return _impl(backend).select_pages(scores, cu_entries, budget_pages)


def sparse_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
                            offsets: torch.Tensor, masks: torch.Tensor, sel: torch.Tensor, count: torch.Tensor,
                            inv_freq: torch.Tensor, scale: float,
                            backend: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """Row r's query q[r] [Hq, D] (rotated at its own position; rows need not be sequences: past queries with
    their own selections are rows too) attends, per KV head h, to the visible slots of entries
    sel[r, h, :count[r, h]] only. Returns out [R, Hq, D] (q's dtype), lse [R, Hq] fp32 (natural log of the
    scaled logits; out 0 and lse -inf where nothing is attended)."""
    return _impl(backend).sparse_decode_attention(q, k_cache, v_cache, block_ids, offsets, masks, sel, count,
                                                  inv_freq, scale)


def sparse_decode_parts(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
                        offsets: torch.Tensor, masks: torch.Tensor, sel: torch.Tensor, count: torch.Tensor,
                        inv_freq: torch.Tensor, scale: float, spare: int = 1,
                        backend: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """``sparse_decode_attention`` left unmerged, with room for partial results over other keys: (outs fp32 [S +
    spare, R, Hq, D], lses fp32 [S + spare, R, Hq]). The first S parts are this attention's (its KV splits: merged by
    log-sum-exp they give ``sparse_decode_attention``'s answer, before the rounding to q's dtype); the last
    ``spare`` are the caller's to fill (the twin's: zeros and -inf; the kernels': unwritten). Merging all parts
    (kernels/lse_merge, ``out_dtype=q.dtype``) is then one launch for attention over the union of the key sets:
    retrieval decode's static set on the GPU and the keys the CPU retrieved (services/engine/decode/retrieval.py)."""
    if isinstance(spare, bool) or not isinstance(spare, int) or spare < 0:
        raise ValueError(f"spare must be an int >= 0, got {spare!r}")
    return _impl(backend).sparse_decode_parts(q, k_cache, v_cache, block_ids, offsets, masks, sel, count, inv_freq,
                                              scale, spare)
