"""Quest decode (decode="quest"): each (sequence, KV head) attends only to the pages (KV blocks) whose key bounds say
they matter, within a budget of tokens; the first ``dense_layers`` layers attend densely.

Page metadata is position-agnostic: per page and KV head, the elementwise min and max of its keys as the pool holds
them, i.e. at chunk-local positions for a shared chunk's blocks. A page placed at offset ``o`` is scored by the
query rotated BACKWARDS by ``o`` (the same deferred rotation the attention kernels apply):
    (R_{m} q)·(R_{o+j} k) = (R_{m-o} q)·(R_j k)    so    score = Σ_i max(q'_i·kmax_i, q'_i·kmin_i),  q' = R_{-o} q
an upper bound of the page's best q·k wherever the chunk is placed. A page's score per KV head is the largest over
the query heads that share it (GQA). The page holding the newest token is always selected; the others by score.

This module is the plain-torch form (``quest_attention``), what the Triton kernels of the next step will be checked
against: it reads every key of the sequence to score and attend (correct, not yet fast), and it computes the page
metadata from the pool at every step rather than keeping it per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.rope import rope_cos_sin
from kernels.rope.reference import rotate
from services.checks import check_int
from services.engine.decode.policy import DecodePolicy


@dataclass(frozen=True, slots=True)
class QuestDecode(DecodePolicy):
    """budget_tokens: the keys a (sequence, KV head) attends per layer, in whole pages (at least one page);
    dense_layers: the first layers, which attend densely (Quest's default, 2)."""

    budget_tokens: int = 2048
    dense_layers: int = 2
    name = "quest"
    replays_graph = False

    def __post_init__(self) -> None:
        check_int("budget_tokens", self.budget_tokens, 1)
        check_int("dense_layers", self.dense_layers, 0)

    def check(self, block_size: int, num_layers: int) -> None:
        """ValueError naming the field for a budget under one page, or more dense layers than the model has."""
        if self.budget_tokens < block_size:
            raise ValueError(f"budget_tokens must be at least one page ({block_size} tokens), got {self.budget_tokens}")
        if self.dense_layers > num_layers:
            raise ValueError(f"dense_layers must be at most the model's {num_layers} layers, got {self.dense_layers}")

    def attend(self, fwd, layer, q, seqs, table, cu_entries):
        if layer < self.dense_layers:
            return fwd.attention.decode(layer, q, table, cu_entries)
        out, _ = quest_attention(q, fwd.pool.k[layer], fwd.pool.v[layer], table.block_ids, table.offsets,
                                 table.masks, cu_entries, fwd.model.inv_freq, fwd.model.scale,
                                 self.budget_tokens // fwd.pool.block_size)
        return out


def page_bounds(k_pages: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k_pages [E, BS, Hkv, D], visible [E, BS] -> fp32 (kmin, kmax) [E, Hkv, D] over each page's visible slots
    (+inf / -inf where a page shows none)."""
    kf = k_pages.float()
    hidden = ~visible[:, :, None, None]
    return kf.masked_fill(hidden, float("inf")).amin(1), kf.masked_fill(hidden, float("-inf")).amax(1)


def page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, offsets: torch.Tensor,
                inv_freq: torch.Tensor) -> torch.Tensor:
    """q [Hq, D] of one sequence, page bounds [E, Hkv, D] at the pages' own (local) positions, each page placed at
    offsets[e] -> fp32 [E, Hkv]: the largest, over the query heads of each KV head, of Σ_i max(q'_i·kmax_i,
    q'_i·kmin_i) with q' = R_{-offset} q (-inf for a page with no visible key)."""
    e, hkv, d = kmax.shape
    cos, sin = rope_cos_sin(offsets.long(), inv_freq)                        # [E, D/2]
    qr = rotate(q.float()[None].expand(e, -1, -1), cos[:, None, :], -sin[:, None, :])  # [E, Hq, D]: R_{-o} q
    qr = qr.view(e, hkv, -1, d)                                              # [E, Hkv, G, D]
    bound = torch.maximum(qr * kmax[:, :, None, :], qr * kmin[:, :, None, :]).sum(-1)  # [E, Hkv, G]
    bound = bound.amax(-1)
    return torch.where(torch.isfinite(kmax).all(-1), bound, float("-inf"))


def select_pages(scores: torch.Tensor, budget_pages: int) -> torch.Tensor:
    """scores [E, Hkv] of one sequence's pages in entry order (the last holds the newest token) -> bool [E, Hkv]:
    per KV head, the last page and the budget_pages - 1 best of the others (every page when they fit)."""
    e, hkv = scores.shape
    chosen = torch.zeros(e, hkv, dtype=torch.bool, device=scores.device)
    chosen[-1] = True
    others = min(budget_pages - 1, e - 1)
    if others > 0:
        top = torch.topk(scores[:-1], others, dim=0).indices                # [others, Hkv]
        chosen[:-1].scatter_(0, top, True)
    return chosen


def quest_attention(q, k_cache, v_cache, block_ids, offsets, masks, cu_entries, inv_freq, scale, budget_pages: int):
    """Decode attention over the selected pages only. q [B, Hq, D]; the paged caches [N, BS, Hkv, D] hold keys at
    their entry's local positions; sequence b's entries table[cu[b]:cu[b+1]] (block id, offset, slot mask), its
    newest token in the last. Returns (out [B, Hq, D] in q's dtype, the selection: a list of bool [E_b, Hkv])."""
    b_n, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    bits = torch.arange(bs, device=q.device, dtype=torch.int64)
    bounds = cu_entries.tolist()
    out = torch.empty_like(q)
    chosen_all = []
    for b in range(b_n):
        lo, hi = bounds[b], bounds[b + 1]
        ids, offs = block_ids[lo:hi].long(), offsets[lo:hi].long()
        visible = ((masks[lo:hi].long()[:, None] >> bits) & 1).bool()       # [E, BS]
        k_pages, v_pages = k_cache[ids], v_cache[ids]                        # [E, BS, Hkv, D]
        kmin, kmax = page_bounds(k_pages, visible)
        chosen = select_pages(page_scores(q[b], kmin, kmax, offs, inv_freq), budget_pages)
        chosen_all.append(chosen)
        cos, sin = rope_cos_sin(offs, inv_freq)                              # keys to their global positions
        keys = rotate(k_pages.float(), cos[:, None, None, :], sin[:, None, None, :])   # [E, BS, Hkv, D]
        qh = q[b].float().view(hkv, group, d)
        logits = torch.einsum("hgd,ebhd->hgeb", qh, keys) * scale            # [Hkv, G, E, BS]
        allowed = visible[None, :, :] & chosen.t()[:, :, None]               # [Hkv, E, BS]
        logits = logits.masked_fill(~allowed[:, None], float("-inf"))
        p = torch.softmax(logits.reshape(hkv, group, -1), dim=-1)
        o = torch.einsum("hgn,nhd->hgd", p, v_pages.float().reshape(-1, hkv, d))
        out[b] = o.reshape(hq, d).to(q.dtype)
    return out, chosen_all
