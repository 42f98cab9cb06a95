"""Paged-cache scenarios for the kernel tests and bench/kernels/kernels.py, built from raw (unrotated) keys.

A sequence is a list of shared chunks placed back to back from ``base`` (chunk i's keys cached at
chunk-local positions 0..L-1, entry offset = the chunk's global start) followed by a private suffix
(keys cached at their global positions, offset 0). Keeping the raw keys lets a test materialise the
whole K eagerly at global positions with apply_rope, independently of the block-table machinery.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.rope import apply_rope

GARBAGE = 100.0  # padding slots hold large finite values: a kernel that reads them shows it


@dataclass(slots=True)
class PagedCase:
    """k_cache, v_cache [N, BS, Hkv, D]; slot_pos int32 [N, BS]; block_ids, offsets int32 [E];
    masks int64 [E]; cu_entries int32 [B+1]. Per sequence b: raw_k[b], v[b] fp32 [S_b, Hkv, D] and
    pos[b] int64 [S_b] for every visible key; length[b] = the next free global position."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_pos: torch.Tensor
    block_ids: torch.Tensor
    offsets: torch.Tensor
    masks: torch.Tensor
    cu_entries: torch.Tensor
    raw_k: list
    v: list
    pos: list
    length: list
    inv_freq: torch.Tensor

    def eager_keys(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sequence b's keys rotated eagerly at their global positions (fp32), values, positions."""
        return apply_rope(self.raw_k[b], self.pos[b], self.inv_freq), self.v[b], self.pos[b]


def build(seqs: list[tuple[list[int], int]], block_size: int, n_kv_heads: int, head_dim: int,
          inv_freq: torch.Tensor, dtype=torch.float32, device="cpu", hide: float = 0.0, base: int = 0,
          gen: torch.Generator | None = None) -> PagedCase:
    """seqs: per sequence (chunk lengths, private suffix length). hide: fraction of visible slots
    masked out at random (as CacheBlend hides recomputed tokens' shared twins). Physical blocks
    are shuffled so that no kernel can rely on them being contiguous."""
    gen = gen or torch.Generator().manual_seed(0)
    runs = []  # (seq, entry offset, n tokens, shared?, global position of the first token)
    for b, (chunks, suffix) in enumerate(seqs):
        start = base
        for n in chunks:
            runs.append((b, start, n, True, start))
            start += n
        if suffix:
            runs.append((b, 0, suffix, False, start))
    n_blocks = sum(-(-r[2] // block_size) for r in runs)
    perm = torch.randperm(n_blocks + 3, generator=gen)[:n_blocks]  # a few blocks never used
    shape = (n_blocks + 3, block_size, n_kv_heads, head_dim)
    k_cache = (torch.randn(shape, generator=gen) * GARBAGE).to(dtype)
    v_cache = (torch.randn(shape, generator=gen) * GARBAGE).to(dtype)
    slot_pos = torch.full(shape[:2], 10**6, dtype=torch.int32)
    ids, offs, masks, counts = [], [], [], [0] * len(seqs)
    raw_k, vals, pos = [[] for _ in seqs], [[] for _ in seqs], [[] for _ in seqs]
    length = [base + sum(c) + s for c, s in seqs]
    nxt = 0
    for b, offset, n, shared, first_global in runs:
        for j0 in range(0, n, block_size):
            blk = int(perm[nxt])
            nxt += 1
            m = min(block_size, n - j0)
            local = torch.arange(j0, j0 + m)
            stored = local if shared else local + first_global  # position the key was rotated at
            gpos = (local + first_global).long()
            rk = torch.randn((m, n_kv_heads, head_dim), generator=gen)
            rv = torch.randn((m, n_kv_heads, head_dim), generator=gen)
            k_cache[blk, :m] = apply_rope(rk, stored, inv_freq).to(dtype)
            v_cache[blk, :m] = rv.to(dtype)
            slot_pos[blk, :m] = stored.to(torch.int32)
            vis = torch.rand(m, generator=gen) >= hide
            mask = sum(1 << t for t in range(m) if vis[t])
            ids.append(blk)
            offs.append(offset if shared else 0)
            masks.append(mask - (1 << 64) if mask >= 1 << 63 else mask)  # bit 63 as a signed int64
            counts[b] += 1
            # the eager reference sees the same values the cache holds
            raw_k[b].append(apply_rope(k_cache[blk, :m].float(), -stored, inv_freq)[vis])
            vals[b].append(v_cache[blk, :m].float()[vis])
            pos[b].append(gpos[vis])
    cu = torch.tensor([0] + counts).cumsum(0).to(torch.int32)
    cat = lambda xs, s: torch.cat(xs) if xs else torch.zeros((0, *s))  # noqa: E731
    return PagedCase(
        k_cache=k_cache.to(device), v_cache=v_cache.to(device), slot_pos=slot_pos.to(device),
        block_ids=torch.tensor(ids, dtype=torch.int32, device=device),
        offsets=torch.tensor(offs, dtype=torch.int32, device=device),
        masks=torch.tensor(masks, dtype=torch.int64, device=device),
        cu_entries=cu.to(device),
        raw_k=[cat(x, (n_kv_heads, head_dim)).to(device) for x in raw_k],
        v=[cat(x, (n_kv_heads, head_dim)).to(device) for x in vals],
        pos=[(torch.cat(x) if x else torch.zeros(0, dtype=torch.long)).to(device) for x in pos],
        length=length, inv_freq=inv_freq.to(device))


def eager_attention(q: torch.Tensor, q_pos: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor,
                    k_pos: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain softmax attention, fp64: q [T, Hq, D] against k, v [S, Hkv, D]; causal by position
    unless q_pos is None. Returns out [T, Hq, D] and lse [T, Hq] (zero / -inf where no key is seen)."""
    t, hq, _ = q.shape
    group = hq // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)  # [S, Hq, D]
    vv = v.double().repeat_interleave(group, dim=1)
    s = torch.einsum("thd,shd->hts", q.double(), kk) * scale
    if q_pos is not None:
        s = s.masked_fill(k_pos[None, None, :] > q_pos.long()[None, :, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [Hq, T]
    p = torch.nan_to_num(torch.exp(s - lse[..., None]), nan=0.0)
    return torch.einsum("hts,shd->thd", p, vv), lse.T


def prefill_queries(case: PagedCase, n_new: list[int], n_scattered: list[int], n_heads: int,
                    dtype=torch.float32, gen: torch.Generator | None = None):
    """Per sequence: the last n_new positions (its suffix) plus n_scattered earlier positions (as
    CacheBlend's recomputed tokens). Returns q [Tq, Hq, D] rotated at q_pos, q_pos int32, cu_q int32."""
    gen = gen or torch.Generator().manual_seed(1)
    dim = case.k_cache.shape[-1]
    qp = []
    for b, length in enumerate(case.length):
        tail = torch.arange(length - n_new[b], length)
        early = torch.randint(0, max(1, length - n_new[b]), (n_scattered[b],), generator=gen)
        qp.append(torch.cat([early, tail]))
    q_pos = torch.cat(qp)
    raw = torch.randn((q_pos.numel(), n_heads, dim), generator=gen)
    q = apply_rope(raw, q_pos, case.inv_freq.cpu()).to(dtype)
    cu_q = torch.tensor([0] + [x.numel() for x in qp]).cumsum(0).to(torch.int32)
    dev = case.k_cache.device
    return q.to(dev), q_pos.to(torch.int32).to(dev), cu_q.to(dev)
