"""Quest sparse decode, plain torch (the twin of ``kernels/sparse/triton.py``).

Layout (shared with kernels/paged_attention and the engine's block pool):
  k_cache, v_cache   [N, BS, Hkv, D]   keys as the pool holds them (chunk-local rotation for shared chunk blocks)
  kmin, kmax         [N, Hkv, D]       per block and KV head, the elementwise min / max of the block's keys as
                                       held (cache dtype); a bound over more slots than an entry shows stays a bound
  block_ids, offsets int32 or int64 [E], masks int64 [E], cu_entries int32 [B+1]: the decode block table; sequence b's
                                       entries are [cu[b], cu[b+1]), its newest token in the last
  sel                int32 [R, Hkv, K] global entry indices, ascending, -1 past count [R, Hkv]

A page placed at offset o is scored, as it is attended, by the query rotated BACKWARDS by o:
    (R_m q)·(R_{o+j} k) = (R_{m-o} q)·(R_j k)   so   score = Σ_i max(q'_i·kmax_i, q'_i·kmin_i),  q' = R_{-o} q,
an upper bound of q·k over the page's keys wherever the chunk is placed; per KV head the largest over its query
heads (GQA). All math in fp32.
"""

from __future__ import annotations

import torch

from kernels.rope.reference import rope_cos_sin, rotate


def page_bounds(k_cache: torch.Tensor, block_ids: torch.Tensor, masks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Page metadata as the engine keeps it, built from a block table: kmin, kmax [N, Hkv, D] in k_cache's dtype,
    over the slots any entry naming the block shows (+inf / -inf for a block no entry shows a slot of)."""
    n, bs, hkv, d = k_cache.shape
    bits = torch.arange(bs, device=masks.device, dtype=torch.int64)
    hidden = ((masks.long()[:, None] >> bits) & 1) == 0                     # [E, BS]
    k = k_cache[block_ids.long()].float()                                   # [E, BS, Hkv, D]
    ent_min = k.masked_fill(hidden[:, :, None, None], float("inf")).amin(1)  # [E, Hkv, D]
    ent_max = k.masked_fill(hidden[:, :, None, None], float("-inf")).amax(1)
    idx = block_ids.long()[:, None, None].expand_as(ent_min)
    kmin = torch.full((n, hkv, d), float("inf"), device=k_cache.device).scatter_reduce_(0, idx, ent_min, "amin")
    kmax = torch.full((n, hkv, d), float("-inf"), device=k_cache.device).scatter_reduce_(0, idx, ent_max, "amax")
    return kmin.to(k_cache.dtype), kmax.to(k_cache.dtype)


def bound_pages(k_cache: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, blocks: torch.Tensor,
                visible: torch.Tensor) -> None:
    """In place: kmin, kmax [N, Hkv, D] of blocks (int [n]) = the min / max of their keys over the slots visible
    (bool [n, BS]) shows; a block named twice gets the bounds of the union of its rows' slots, a block with no visible
    slot +inf / -inf. What the engine's BlockPool.bound computes at every sparse layer of a decode step."""
    if not blocks.numel():
        return
    ids = blocks.long()
    k = k_cache[ids]                                                        # [n, BS, Hkv, D]
    hidden = ~visible.bool()[:, :, None, None]
    lo = k.masked_fill(hidden, float("inf")).amin(1)                        # [n, Hkv, D]
    hi = k.masked_fill(hidden, float("-inf")).amax(1)
    idx = ids[:, None, None].expand_as(lo)
    kmin.scatter_reduce_(0, idx, lo, "amin", include_self=False)
    kmax.scatter_reduce_(0, idx, hi, "amax", include_self=False)


def entry_sequences(cu_entries: torch.Tensor, n_entries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence of each entry, int64 [E], and whether it is one of a sequence's, bool [E] (no host sync): a
    table may hold entries before cu[0] and past cu[-1] (a decode graph's views and padding), which are no
    sequence's."""
    cu = cu_entries.long()
    e = torch.arange(n_entries, device=cu.device)
    seq = torch.searchsorted(cu[1:], e, right=True).clamp(max=max(cu.numel() - 2, 0))
    return seq, (e >= cu[0]) & (e < cu[-1])


def page_scores(q, kmin, kmax, block_ids, offsets, masks, cu_entries, inv_freq):
    """q [B, Hq, D] rotated at each sequence's position -> fp32 [E, Hkv]: per entry and KV head the largest, over
    the KV head's query heads, of Σ_i max(q'_i·kmax_i, q'_i·kmin_i), q' = R_{-offset} q of the entry's sequence;
    -inf for an entry whose mask shows no slot."""
    e = block_ids.numel()
    hkv, d = kmax.shape[1], kmax.shape[2]
    cos, sin = rope_cos_sin(offsets.long(), inv_freq)                       # [E, D/2]
    seq, inside = entry_sequences(cu_entries, e)
    qe = q.float()[seq]                                                     # [E, Hq, D]
    qr = rotate(qe, cos[:, None, :], -sin[:, None, :]).view(e, hkv, -1, d)  # R_{-o} q: [E, Hkv, G, D]
    ids = block_ids.long()
    hi = kmax[ids].float()[:, :, None, :]                                   # [E, Hkv, 1, D]
    lo = kmin[ids].float()[:, :, None, :]
    bound = torch.maximum(qr * hi, qr * lo).sum(-1).amax(-1)                # [E, Hkv]
    return torch.where(((masks != 0) & inside)[:, None], bound, float("-inf"))


def select_pages(scores, cu_entries, budget_pages: int):
    """scores fp32 [E, Hkv] -> (sel int32 [B, Hkv, K], count int32 [B, Hkv]), K = budget_pages: per sequence and
    KV head its last entry and the budget_pages - 1 best of its others, -inf never, as global entry indices in
    ascending order, -1 past count."""
    bounds = cu_entries.tolist()
    b_n, hkv = len(bounds) - 1, scores.shape[1]
    sel = torch.full((b_n, hkv, budget_pages), -1, dtype=torch.int32, device=scores.device)
    count = torch.zeros((b_n, hkv), dtype=torch.int32, device=scores.device)
    for b in range(b_n):
        lo, hi = bounds[b], bounds[b + 1]
        if hi == lo:
            continue
        for h in range(hkv):
            others = scores[lo:hi - 1, h]
            ok = torch.nonzero(others > float("-inf")).flatten()
            keep = ok[torch.topk(others[ok], min(budget_pages - 1, ok.numel())).indices]
            if scores[hi - 1, h] > float("-inf"):
                keep = torch.cat([keep, keep.new_tensor([hi - 1 - lo])])
            keep = torch.sort(keep).values + lo
            sel[b, h, :keep.numel()] = keep.to(torch.int32)
            count[b, h] = keep.numel()
    return sel, count


def sparse_decode_attention(q, k_cache, v_cache, block_ids, offsets, masks, sel, count, inv_freq, scale,
                            exact_dtype: torch.dtype | None = None):
    """Row r's query [Hq, D] (rotated at its own position) attends, per KV head h, to the visible slots of entries
    sel[r, h, :count[r, h]], keys rotated forward by their entry's offset. Returns out [R, Hq, D] (q's dtype) and
    lse [R, Hq] fp32 (natural log of the scaled logits; out 0, lse -inf where nothing is attended). ``exact_dtype``:
    out in that dtype instead (``sparse_decode_parts``: fp32, not rounded to q's)."""
    r_n, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    taken = torch.arange(sel.shape[2], device=sel.device) < count[:, :, None]       # [R, Hkv, K]
    ent = torch.where(taken, sel, 0).long()
    heads = torch.arange(hkv, device=q.device)[None, :, None]
    blk = block_ids.long()[ent]
    k = k_cache[blk, :, heads].float()                                      # [R, Hkv, K, BS, D]
    v = v_cache[blk, :, heads].float()
    cos, sin = rope_cos_sin(offsets.long()[ent], inv_freq)                  # [R, Hkv, K, D/2]
    k = rotate(k, cos[:, :, :, None], sin[:, :, :, None])
    bits = torch.arange(bs, device=q.device, dtype=torch.int64)
    vis = (((masks.long()[ent][..., None] >> bits) & 1) != 0) & taken[..., None]  # [R, Hkv, K, BS]
    qg = q.float().view(r_n, hkv, hq // hkv, d)                            # [R, Hkv, G, D]
    logits = torch.einsum("rhgd,rhksd->rhgks", qg, k) * scale               # [R, Hkv, G, K, BS]
    logits = logits.masked_fill(~vis[:, :, None], float("-inf")).flatten(3)
    lse = torch.logsumexp(logits, dim=-1)                                   # [R, Hkv, G]
    p = torch.nan_to_num(torch.exp(logits - lse[..., None]), nan=0.0)      # rows that see nothing: 0
    out = torch.einsum("rhgn,rhnd->rhgd", p, v.flatten(2, 3))
    return out.reshape(r_n, hq, d).to(q.dtype if exact_dtype is None else exact_dtype), lse.reshape(r_n, hq)


def sparse_decode_parts(q, k_cache, v_cache, block_ids, offsets, masks, sel, count, inv_freq, scale, spare: int):
    """``sparse_decode_attention`` unmerged, with room for other partial results: (outs fp32 [1 + spare, R, Hq, D],
    lses fp32 [1 + spare, R, Hq]), part 0 this attention (one part: the twin has no KV splits), the last ``spare``
    left for the caller (zeros and -inf: parts that saw nothing)."""
    out, lse = sparse_decode_attention(q, k_cache, v_cache, block_ids, offsets, masks, sel, count, inv_freq, scale,
                                       exact_dtype=torch.float32)
    outs = torch.zeros((1 + spare,) + tuple(out.shape), dtype=torch.float32, device=q.device)
    lses = torch.full((1 + spare,) + tuple(lse.shape), float("-inf"), dtype=torch.float32, device=q.device)
    outs[0], lses[0] = out, lse
    return outs, lses
