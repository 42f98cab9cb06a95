"""Triton form of kernels/sparse/retro.py's ``quest_retro_attention``: a RetroAttention step's sparse layer, each
selected page read once for the current rows and their past rows.

One program per (current row b, KV head, split) over a run of b's selection. It first finds, for each of b's past
rows (``_unseen``), which of the selected pages are new to it (existed at its step, not seen: its candidates tested
against its seen pages tile by tile) and stores them as flags for its run; then it attends the run as
kernels/sparse/_attend.py does (its table reads, its deferred rotation, the shared online-softmax tile, its split
count), with the past rows' queries as more rows of each lane's tile that see a page only where it is new to them.
The past rows' results are merged by log-sum-exp with their prior outputs: in the kernel when there is one split
(one launch), else with the splits' parts by kernels/lse_merge's merge_attention (two launches). It replaces the current
rows' sparse attention and the past rows' correction, which read the pages twice (bench/decode/README.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.lse_merge.triton import merge_attention, merge_finish, merge_step
from kernels.paged_attention._decode import merge_lanes
from kernels.paged_attention._meta import dot_f32
from kernels.sparse._attend import LOG2E, AttendConfig, attend_run, pick_splits
from kernels.sparse.triton import _check_query, _table

SEEN_TILE = 64


@dataclass(frozen=True, slots=True)
class RetroConfig:
    """Launch shape of ``quest_retro_attention``. lanes: entries a step (None: 16 tl.dot rows' worth, a lane's rows
    being its kinds (the current row and its past rows, to a power of two) x group heads, at most 64 keys); splits
    (None: picked as _attend picks them, from the selection's width: no host sync for the counts) cut each
    selection into runs of whole steps, so that rows x KV heads x splits fill about waves x SMs x programs_per_sm
    programs; num_stages (None: as _attend picks them); seen_tile: seen pages tested at once."""

    # NOTE: 16 rows a step, not _attend's lanes with the past rows added: on an H200 (bench/decode/README.md) 4 lanes
    # x 8 rows took 42.4 us at 32K, batch 4, budget 2048 against 30.8 for 2 lanes x 8 rows (15.2 / 15.1 at batch 1)
    num_warps: int = 8
    num_stages: int | None = None
    lanes: int | None = None
    waves: float = 1.0
    programs_per_sm: int = 2
    num_splits: int | None = None
    seen_tile: int = SEEN_TILE

    def __post_init__(self):
        if self.lanes is not None and (self.lanes < 1 or self.lanes & (self.lanes - 1)):
            raise ValueError(f"lanes must be a power of two, got {self.lanes}")
        if self.seen_tile < 1 or self.seen_tile & (self.seen_tile - 1):
            raise ValueError(f"seen_tile must be a power of two, got {self.seen_tile}")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")


@triton.jit
def _unseen(pick_ptr, b, ent_ptr, seen_ptr, cu_ptr, r, h, s_pb, s_ph, s_sr, s_sh,
            K: tl.constexpr, K_PAD: tl.constexpr, WIDTH: tl.constexpr, TILE: tl.constexpr):
    """Row r's candidates for KV head h, from its sequence b's selection: picked [K_PAD] (global entry indices, -1
    past the selection), new [K_PAD] (existed at its step, not seen), each new one's rank pos [K_PAD] and their
    count."""
    b = b.to(tl.int64)
    start = tl.load(cu_ptr + b).to(tl.int64)
    kk = tl.arange(0, K_PAD)
    picked = tl.load(pick_ptr + b * s_pb + h * s_ph + kk, mask=kk < K, other=-1).to(tl.int64)
    cand = tl.where(picked >= 0, picked - start, -1)                 # within the sequence
    limit = tl.load(ent_ptr + r).to(tl.int64)
    new = (cand >= 0) & (cand < limit)
    seen_row = seen_ptr + r.to(tl.int64) * s_sr + h * s_sh
    # NOTE: unrolled (WIDTH constexpr): every tile's load is issued at once, not one load's latency a tile
    for w0 in tl.static_range(0, WIDTH, TILE):
        ww = w0 + tl.arange(0, TILE)
        s = tl.load(seen_row + ww, mask=ww < WIDTH, other=-1).to(tl.int64)
        hit = tl.max((cand[:, None] == s[None, :]).to(tl.int32), axis=1)
        new = new & (hit == 0)
    take = new.to(tl.int32)
    return picked, new, tl.cumsum(take, axis=0) - take, tl.sum(take, axis=0)


@triton.jit
def _quest_retro_kernel(
    q_ptr, qp_ptr, k_ptr, v_ptr, ids_ptr, off_ptr, mask_ptr, invf_ptr,
    sel_ptr, cnt_ptr, ent_ptr, seen_ptr, cu_ptr, flag_ptr, pcnt_ptr,
    oin_ptr, lin_ptr, out_ptr, lse_ptr,
    qk_scale, per, n_cur,
    stride_qr, stride_qh, stride_pr, stride_ph, stride_kb, stride_ks, stride_kh, s_pb, s_ph, stride_cr, s_sr, s_sh,
    stride_fr, stride_fh, stride_ir, stride_ih, stride_jr, stride_os, stride_or, stride_oh, stride_ls, stride_lr,
    K: tl.constexpr, K_PAD: tl.constexpr, WIDTH: tl.constexpr, TILE: tl.constexpr, P: tl.constexpr,
    KINDS: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, NB: tl.constexpr, ROWS: tl.constexpr,
    BS: tl.constexpr, D2: tl.constexpr, DOT_F32: tl.constexpr, NSPLIT: tl.constexpr,
):
    """Program (current row b, KV head h, split): the run [split * per, + per) of b's selection, each page read once
    for b's query and its P past rows b * P + c (those to which the page is new). Output rows: b, then n_cur + its
    past rows. One split: final (q's dtype), the past rows merged with their priors here; several: each split's part
    (fp32) at its index, and split 0 puts the priors (current rows: none) at part NSPLIT for merge_attention."""
    RPL: tl.constexpr = KINDS * G_PAD
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    n_sel = tl.load(cnt_ptr + b.to(tl.int64) * stride_cr + h)
    lo = split * per
    hi = tl.minimum(lo + per, n_sel)
    kk = tl.arange(0, K_PAD)
    # each past row's new pages among this run of b's selection, as flags by selection slot; split 0 counts them all
    for c in tl.static_range(P):
        pr = b.to(tl.int64) * P + c
        _, new, _, n_new = _unseen(sel_ptr, b, ent_ptr, seen_ptr, cu_ptr, pr, h, s_pb, s_ph, s_sr, s_sh,
                                   K, K_PAD, WIDTH, TILE)
        tl.store(flag_ptr + pr * stride_fr + h * stride_fh + kk, new.to(tl.int8), mask=(kk >= lo) & (kk < hi))
        tl.store(pcnt_ptr + pr * tl.num_programs(1) + h, n_new, mask=split == 0)
    # NOTE: the flags are read back below by other threads than those that stored them: a barrier between
    tl.debug_barrier()
    sel_row = sel_ptr + b.to(tl.int64) * s_pb + h * s_ph
    mask_lo_ptr = mask_ptr.to(tl.pointer_type(tl.int32))          # little-endian: word 2e is entry e's low 32 bits
    m_i, l_i, acc = attend_run(q_ptr, k_ptr, v_ptr, ids_ptr, off_ptr, mask_lo_ptr, invf_ptr, sel_row, b, h, lo,
                               hi, qk_scale, stride_qr, stride_qh, stride_kb, stride_ks, stride_kh,
                               qp_ptr, flag_ptr, stride_pr, stride_ph, stride_fr, stride_fh,
                               G, G_PAD, NB, ROWS, BS, D2, DOT_F32, P, KINDS)
    out, lse = merge_lanes(m_i, l_i, acc, ROWS, RPL, D2)           # [RPL, D], [RPL]: rows (kind, group head)

    dd = tl.arange(0, 2 * D2)
    kg = tl.arange(0, RPL)
    c2 = kg // G_PAD
    g2 = kg % G_PAD
    ok = (g2 < G) & (c2 <= P)
    is_past = ok & (c2 > 0)
    heads = h * G + g2
    past = b.to(tl.int64) * P + tl.maximum(c2 - 1, 0)
    dest = tl.where(c2 == 0, b.to(tl.int64), n_cur + past)         # the output row of (kind, head)
    lin_row = lin_ptr + past * stride_jr + heads
    oin_row = oin_ptr + past[:, None] * stride_ir + heads[:, None] * stride_ih + dd[None, :]
    o_row = out_ptr + split * stride_os + dest[:, None] * stride_or + heads[:, None] * stride_oh + dd[None, :]
    l_row = lse_ptr + split * stride_ls + dest * stride_lr + heads
    if NSPLIT == 1:   # the past rows' priors merged here, by lse_merge's arithmetic (a prior of -inf weighs nothing)
        lse_in = tl.load(lin_row, mask=is_past, other=float("-inf"))
        o_in = tl.load(oin_row, mask=is_past[:, None], other=0.0)
        m = tl.full([RPL], float("-inf"), tl.float32)
        m, l, acc = merge_step(m, tl.zeros([RPL], tl.float32), tl.zeros([RPL, 2 * D2], tl.float32), lse, out)
        m, l, acc = merge_step(m, l, acc, lse_in, o_in)
        out, lse = merge_finish(m, l, acc)
    tl.store(o_row, out.to(out_ptr.dtype.element_ty), mask=ok[:, None])
    tl.store(l_row, lse, mask=ok)
    if NSPLIT > 1:
        if split == 0:
            tl.store(o_row + NSPLIT * stride_os,
                     tl.load(oin_row, mask=is_past[:, None], other=0.0).to(tl.float32), mask=ok[:, None])
            tl.store(l_row + NSPLIT * stride_ls, tl.load(lin_row, mask=is_past, other=float("-inf")), mask=ok)


def quest_retro_launch(q, q_past, k_cache, v_cache, block_ids, offsets, masks, sel, count, entries, seen, cu, out_in,
                       lse_in, inv_freq, scale, *, cfg: RetroConfig = RetroConfig()):
    """Inputs checked by quest_retro_attention_triton. Returns out [B, Hq, D], lse [B, Hq], out_past [R, Hq, D],
    lse_past [R, Hq] and count_past int32 [R, Hkv] (views of one output each: rows b, then the past rows)."""
    n_cur, hq, dim = q.shape
    n_past = q_past.shape[0]
    past = n_past // n_cur if n_cur else 0
    _, bs, hkv, _ = k_cache.shape
    k, width = sel.shape[2], seen.shape[2]
    group = hq // hkv
    g_pad = triton.next_power_of_2(group)
    kinds = triton.next_power_of_2(1 + past)
    nb = cfg.lanes or max(1, min(16 // (kinds * g_pad), 64 // bs))
    split_cfg = AttendConfig(waves=cfg.waves, programs_per_sm=cfg.programs_per_sm, num_splits=cfg.num_splits)
    nsplit, per = pick_splits(split_cfg, n_cur, hkv, k, nb, q.device)
    stages = cfg.num_stages or (3 if per // nb >= split_cfg.pipelined_from else 1)
    total = n_cur + n_past
    if nsplit == 1:
        out = torch.empty((total, hq, dim), dtype=q.dtype, device=q.device)
        lse = torch.empty((total, hq), dtype=torch.float32, device=q.device)
        o_strides, l_strides = (0, out.stride(0), out.stride(1)), (0, lse.stride(0))
    else:   # the splits' parts and the priors (part nsplit)
        out = torch.empty((nsplit + 1, total, hq, dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((nsplit + 1, total, hq), dtype=torch.float32, device=q.device)
        o_strides, l_strides = (out.stride(0), out.stride(1), out.stride(2)), (lse.stride(0), lse.stride(1))
    flags = torch.empty((n_past, hkv, max(k, 1)), dtype=torch.int8, device=q.device)      # scratch
    count_past = torch.empty((n_past, hkv), dtype=torch.int32, device=q.device)
    if n_cur:
        _quest_retro_kernel[(n_cur, hkv, nsplit)](
            q, q_past, k_cache, v_cache, block_ids, offsets, masks, inv_freq,
            sel, count, entries, seen, cu, flags, count_past, out_in, lse_in, out, lse,
            float(scale) * LOG2E.value, per, n_cur,
            q.stride(0), q.stride(1), q_past.stride(0), q_past.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            sel.stride(0), sel.stride(1), count.stride(0), seen.stride(0), seen.stride(1),
            flags.stride(0), flags.stride(1), out_in.stride(0), out_in.stride(1), lse_in.stride(0),
            *o_strides, *l_strides,
            K=k, K_PAD=triton.next_power_of_2(max(k, 1)), WIDTH=width, TILE=cfg.seen_tile, P=past, KINDS=kinds,
            G=group, G_PAD=g_pad, NB=nb, ROWS=max(16, nb * kinds * g_pad), BS=bs, D2=dim // 2,
            DOT_F32=dot_f32(q.dtype), NSPLIT=nsplit, num_warps=cfg.num_warps, num_stages=stages)
    if nsplit > 1:
        out, lse = merge_attention(out, lse, q.dtype)
    return out[:n_cur], lse[:n_cur], out[n_cur:], lse[n_cur:], count_past


def quest_retro_attention_triton(q, q_past, k_cache, v_cache, block_ids, offsets, masks, sel, count, entries, seen,
                                 cu, out_in, lse_in, inv_freq, scale):
    """See kernels/sparse/retro.py's quest_retro_attention: its inputs checked once, then one launch (two when the
    selection is split)."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() \
            or k_cache.stride(3) != 1:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
                         "[N, BS, Hkv, D], with one set of strides and a contiguous head dimension")
    for t in (q, q_past):
        _check_query(t, k_cache.shape[3], inv_freq)
    if q.dtype != q_past.dtype or q.shape[1] != q_past.shape[1]:
        raise ValueError(f"q {q.dtype} {tuple(q.shape)} and q_past {q_past.dtype} {tuple(q_past.shape)} must share "
                         "a dtype and their heads")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} KV heads")
    if not q.dtype == k_cache.dtype == v_cache.dtype == out_in.dtype:
        raise ValueError(f"q, k_cache, v_cache and out_in dtypes differ: {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}, {out_in.dtype}")
    n_cur = q.shape[0]
    n_past, hkv = q_past.shape[0], k_cache.shape[2]
    if n_cur == 0 and n_past or n_cur and n_past % n_cur:
        raise ValueError(f"{n_past} past rows are not a whole number a row for {n_cur} rows")
    if sel.dim() != 3 or sel.shape[:2] != (n_cur, hkv) or count.shape != (n_cur, hkv):
        raise ValueError(f"sel {tuple(sel.shape)} must be [B, Hkv, K] and count {tuple(count.shape)} [B, Hkv] for "
                         f"{n_cur} rows and {hkv} KV heads")
    if seen.dim() != 3 or seen.shape[:2] != (n_past, hkv) or entries.shape != (n_past,) or cu.shape != (n_cur + 1,):
        raise ValueError(f"seen {tuple(seen.shape)} must be [R, Hkv, W], entries {tuple(entries.shape)} [R] for "
                         f"{n_past} past rows and cu {tuple(cu.shape)} [{n_cur + 1}]")
    if out_in.shape != q_past.shape or lse_in.shape != q_past.shape[:2] or lse_in.dtype != torch.float32:
        raise ValueError(f"out_in {tuple(out_in.shape)} must be q_past's shape and lse_in {lse_in.dtype} "
                         f"{tuple(lse_in.shape)} fp32 [R, Hq]")
    block_ids, offsets, masks = _table(block_ids, offsets, masks)
    last = lambda t: t if t.stride(-1) == 1 else t.contiguous()     # noqa: E731
    return quest_retro_launch(
        last(q), last(q_past), k_cache, v_cache, block_ids, offsets, masks, sel.to(torch.int32).contiguous(),
        count.to(torch.int32).contiguous(), entries.contiguous(), seen.contiguous(), cu.contiguous(), last(out_in),
        last(lse_in), inv_freq.to(device=q.device, dtype=torch.float32).contiguous(), scale)
