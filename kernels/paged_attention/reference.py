"""Deferred-RoPE paged attention, plain torch (the twin of ``kernels/paged_attention/triton.py``).

Layout (shared with the engine's block pool):
  k_cache, v_cache  [N, BS, Hkv, D]   N physical blocks of BS slots
  slot_pos          int32 [N, BS]     position each slot's key was rotated at when written
                                      (chunk-local for shared chunk blocks, global for private ones)
A sequence's keys are the union of its block-table entries e = (block_ids[e], offsets[e], masks[e]):
  - the entry's keys are rotated forward by offsets[e] inside attention (R_off R_local k = R_global k),
  - a key's global position is offsets[e] + slot_pos[block, t] (causality compares it with q_pos),
  - bit t of masks[e] (int64) says whether slot t is visible (padding and recomputed twins are hidden).
Entries of sequence b are block_ids[cu_entries[b]:cu_entries[b+1]]; its queries are
q[cu_q[b]:cu_q[b+1]]. Order of entries does not matter: softmax is permutation invariant.

Math in fp32; outputs in q's dtype, log-sum-exp (natural log, of scaled scores) in fp32.
A query that sees no key gets output 0 and lse -inf.
"""

from __future__ import annotations

import torch

from kernels.rope.reference import rope_cos_sin, rotate


def _entry_keys(k_cache, v_cache, slot_pos, block_ids, offsets, masks, inv_freq):
    """Gather one sequence's keys rotated to global positions. Returns k, v fp32 [S, Hkv, D], pos [S], visible [S]."""
    n_slots = k_cache.shape[1]
    ids = block_ids.long()
    k = k_cache[ids].to(torch.float32)  # [E, BS, Hkv, D]
    v = v_cache[ids].to(torch.float32)
    cos, sin = rope_cos_sin(offsets.long(), inv_freq)  # [E, D/2]
    k = rotate(k, cos[:, None, None, :], sin[:, None, None, :])
    pos = offsets.long()[:, None] + slot_pos[ids].long()  # [E, BS]
    bits = torch.arange(n_slots, device=masks.device, dtype=torch.int64)
    visible = ((masks.long()[:, None] >> bits) & 1).bool()  # [E, BS]
    d = k.shape[-1]
    return (
        k.reshape(-1, k.shape[2], d),
        v.reshape(-1, v.shape[2], d),
        pos.reshape(-1),
        visible.reshape(-1),
    )


def _attend(q, q_pos, k, v, k_pos, visible, scale):
    """q [T, Hq, D] fp32 against k, v [S, Hkv, D]; q_pos None means no causal mask."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    qg = q.reshape(t, hkv, group, d).permute(1, 2, 0, 3)  # [Hkv, G, T, D]
    kk = k.permute(1, 2, 0)  # [Hkv, D, S]
    scores = torch.matmul(qg, kk.unsqueeze(1)) * scale  # [Hkv, G, T, S]
    allowed = visible[None, :].expand(t, -1)
    if q_pos is not None:
        allowed = allowed & (k_pos[None, :] <= q_pos.long()[:, None])
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hkv, G, T]
    probs = torch.exp(scores - lse.unsqueeze(-1).clamp_min(torch.finfo(torch.float32).min))
    probs = torch.nan_to_num(probs, nan=0.0)
    out = torch.matmul(probs, v.permute(1, 0, 2).unsqueeze(1))  # [Hkv, G, T, D]
    return out.permute(2, 0, 1, 3).reshape(t, hq, d), lse.permute(2, 0, 1).reshape(t, hq)


def paged_prefill_attention(q, q_pos, k_cache, v_cache, slot_pos, block_ids, offsets, masks,
                            cu_q, cu_entries, inv_freq, scale):
    """New tokens attend to their sequence's entries, causal by global position.

    q [Tq, Hq, D] rotated at global q_pos [Tq]; cu_q, cu_entries int32 [B+1].
    Returns out [Tq, Hq, D] (q.dtype) and lse [Tq, Hq] fp32.
    """
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(cu_q.numel() - 1):
        q0, q1 = int(cu_q[b]), int(cu_q[b + 1])
        e0, e1 = int(cu_entries[b]), int(cu_entries[b + 1])
        if q1 == q0 or e1 == e0:
            continue
        k, v, k_pos, vis = _entry_keys(k_cache, v_cache, slot_pos, block_ids[e0:e1], offsets[e0:e1], masks[e0:e1], inv_freq)
        o, l = _attend(q[q0:q1].to(torch.float32), q_pos[q0:q1], k, v, k_pos, vis, scale)
        out[q0:q1] = o.to(q.dtype)
        lse[q0:q1] = l
    return out, lse


def paged_decode_attention(q, k_cache, v_cache, block_ids, offsets, masks, cu_entries, inv_freq, scale):
    """One query per sequence over all its visible entries (no causal mask: every key is older).

    q [B, Hq, D] rotated at the sequence's current global position. Returns out [B, Hq, D], lse [B, Hq].
    The Triton kernel rotates q backwards by each entry's offset instead of rotating keys forwards:
    (R_m q)·(R_{o+j} k) == (R_{m-o} q)·(R_j k), the same math.
    """
    dummy_pos = torch.zeros(k_cache.shape[:2], dtype=torch.int32, device=k_cache.device)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(q.shape[0]):
        e0, e1 = int(cu_entries[b]), int(cu_entries[b + 1])
        if e1 == e0:
            continue
        k, v, _, vis = _entry_keys(k_cache, v_cache, dummy_pos, block_ids[e0:e1], offsets[e0:e1], masks[e0:e1], inv_freq)
        o, l = _attend(q[b:b + 1].to(torch.float32), None, k, v, None, vis, scale)
        out[b] = o[0].to(q.dtype)
        lse[b] = l[0]
    return out, lse
