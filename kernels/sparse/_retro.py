"""Triton forms of kernels/sparse/retro.py: ``new_pages`` and ``retro_attention``.

Both start alike (``_unseen``), in one program per (past row, KV head) and, for retro_attention, split: the row's
candidate pages (its sequence's selection now) are tested against the pages it has seen, tile by tile, and the new
ones get their ranks by a prefix sum. ``new_pages`` stores them compacted. ``retro_attention`` stores each split's
run of them to a scratch list, attends the row's query to the run as kernels/sparse/_attend.py does (its table
reads, its deferred rotation, the shared online-softmax tile, its split count), and merges by log-sum-exp with the
row's prior output: in the kernel when there is one split (one launch), else the splits' parts and the prior by
kernels/lse_merge's merge_rows (two launches). It replaces a page-set kernel, a sparse attention (one or two
launches), two stacks and a merge."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.lse_merge.triton import UNROLL_PARTS, merge_finish, merge_rows
from kernels.paged_attention._decode import merge_lanes
from kernels.paged_attention._meta import dot_f32
from kernels.sparse._attend import LOG2E, AttendConfig, attend_run, pick_splits
from kernels.sparse.triton import _check_query, _table

SEEN_TILE = 64


@dataclass(frozen=True, slots=True)
class RetroConfig:
    """Launch shape of ``retro_attention``. lanes: entries a step (None: _attend's, 16 tl.dot rows' worth, at most
    64 keys); splits (None: picked as _attend picks them, from the selection's width: no host sync for the counts)
    cut each row's new pages into runs of whole steps, so that rows x KV heads x splits fill about waves x SMs x
    programs_per_sm programs; seen_tile: seen pages tested at once."""

    # NOTE: splits, not one program per (row, KV head): with the bench's random weights ~119 of a row's 128
    # selected pages are new at each step, and one program walking them in ~30 serial steps made Retro's step
    # 1.59x Quest's at 32K, batch 1 on an H200 (1.20x with the launches this kernel replaced; bench/decode's
    # results at e8e9121 and b33c929)
    num_warps: int = 8
    # None: retro_attention 1 (_attend: 3 stages lose up to 84% at one or two steps a program); the fused kernel
    # as _attend picks it
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
def _new_pages_kernel(pick_ptr, seq_ptr, ent_ptr, seen_ptr, cu_ptr, sel_ptr, cnt_ptr,
                      s_pb, s_ph, s_sr, s_sh, s_or, s_oh,
                      K: tl.constexpr, K_PAD: tl.constexpr, WIDTH: tl.constexpr, TILE: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    picked, new, pos, count = _unseen(pick_ptr, tl.load(seq_ptr + r), ent_ptr, seen_ptr, cu_ptr, r, h, s_pb, s_ph, s_sr, s_sh,
                                      K, K_PAD, WIDTH, TILE)
    kk = tl.arange(0, K_PAD)
    out_row = sel_ptr + r.to(tl.int64) * s_or + h * s_oh
    # every slot at or past the count is -1, each written once: the new pages land at their ranks below it
    tl.store(out_row + kk, tl.full([K_PAD], -1, tl.int32), mask=(kk < K) & (kk >= count))
    tl.store(out_row + pos, picked.to(tl.int32), mask=new)
    tl.store(cnt_ptr + r.to(tl.int64) * tl.num_programs(1) + h, count)


def new_pages_triton(picked, seq_of, entries, seen, cu):
    r, hkv, w = seen.shape
    k = picked.shape[-1]
    sel = torch.empty((r, hkv, k), dtype=torch.int32, device=picked.device)
    count = torch.empty((r, hkv), dtype=torch.int32, device=picked.device)
    if r and hkv:
        picked, seen = picked.contiguous(), seen.contiguous()
        _new_pages_kernel[(r, hkv)](
            picked, seq_of, entries, seen, cu, sel, count,
            picked.stride(0), picked.stride(1), seen.stride(0), seen.stride(1), sel.stride(0), sel.stride(1),
            K=k, K_PAD=triton.next_power_of_2(max(k, 1)), WIDTH=w, TILE=SEEN_TILE)
    return sel, count


@triton.jit
def _retro_attention_kernel(
    q_ptr, k_ptr, v_ptr, ids_ptr, off_ptr, mask_ptr, invf_ptr,
    pick_ptr, seq_ptr, ent_ptr, seen_ptr, cu_ptr, list_ptr, cnt_ptr,
    oin_ptr, lin_ptr, out_ptr, lse_ptr,
    qk_scale, per,
    stride_qr, stride_qh, stride_kb, stride_ks, stride_kh, s_pb, s_ph, s_sr, s_sh,
    stride_ir, stride_ih, stride_jr, stride_os, stride_or, stride_oh, stride_ls, stride_lr,
    K: tl.constexpr, K_PAD: tl.constexpr, WIDTH: tl.constexpr, TILE: tl.constexpr,
    G: tl.constexpr, G_PAD: tl.constexpr, NB: tl.constexpr, ROWS: tl.constexpr, BS: tl.constexpr,
    D2: tl.constexpr, DOT_F32: tl.constexpr, NSPLIT: tl.constexpr,
):
    """Program (row, KV head, split): the split's run [split * per, + per) of the row's new pages. One split: the
    result merged with the prior and stored in q's dtype; several: each split's part (fp32) stored at its index
    and split 0 copies the prior to part NSPLIT, for merge_rows."""
    LANES: tl.constexpr = ROWS // G_PAD
    r_id = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    picked, new, pos, n_sel = _unseen(pick_ptr, tl.load(seq_ptr + r_id), ent_ptr, seen_ptr, cu_ptr, r_id, h, s_pb, s_ph, s_sr, s_sh,
                                      K, K_PAD, WIDTH, TILE)
    lo = split * per
    hi = tl.minimum(lo + per, n_sel)
    row = r_id.to(tl.int64) * tl.num_programs(1) + h
    sel_row = list_ptr + row * K                                    # the compacted new pages, [K] (scratch)
    # each split stores the run it reads (the splits' stores never overlap)
    tl.store(sel_row + pos, picked.to(tl.int32), mask=new & (pos >= lo) & (pos < hi))
    tl.store(cnt_ptr + row, n_sel, mask=split == 0)
    # NOTE: the run is read back below by other threads than those that stored it: a barrier between
    tl.debug_barrier()
    mask_lo_ptr = mask_ptr.to(tl.pointer_type(tl.int32))          # little-endian: word 2e is entry e's low 32 bits

    # as _attend: lane j attends to the j-th new page of every step
    m_i, l_i, acc = attend_run(q_ptr, k_ptr, v_ptr, ids_ptr, off_ptr, mask_lo_ptr, invf_ptr, sel_row, r_id, h, lo,
                               hi, qk_scale, stride_qr, stride_qh, stride_kb, stride_ks, stride_kh,
                               q_ptr, cnt_ptr, 0, 0, 0, 0, G, G_PAD, NB, ROWS, BS, D2, DOT_F32, 0, 1)
    dd = tl.arange(0, 2 * D2)

    # per group head, the LANES lanes (and, one split, the prior: a part of weight exp(lse_in)) merged by
    # log-sum-exp
    gg = tl.arange(0, G_PAD)
    g_ok = gg < G
    heads = h * G + gg
    lin_row = lin_ptr + r_id.to(tl.int64) * stride_jr + heads
    oin_row = oin_ptr + r_id.to(tl.int64) * stride_ir + heads[:, None] * stride_ih + dd[None, :]
    if NSPLIT == 1:
        lse_in = tl.load(lin_row, mask=g_ok, other=float("-inf")) * LOG2E
        o_in = tl.load(oin_row, mask=g_ok[:, None], other=0.0).to(tl.float32)    # [G_PAD, D]
    else:
        lse_in = tl.full([G_PAD], float("-inf"), tl.float32)
        o_in = tl.zeros([G_PAD, 2 * D2], tl.float32)
    m3 = tl.reshape(m_i, [LANES, G_PAD])
    m_g = tl.maximum(tl.max(m3, axis=0), lse_in)                    # [G_PAD], log2 units
    m_gs = tl.where(m_g == float("-inf"), 0.0, m_g)
    w = tl.math.exp2(m3 - m_gs[None, :])                            # [LANES, G_PAD]
    w_in = tl.math.exp2(lse_in - m_gs)
    l_g = tl.sum(w * tl.reshape(l_i, [LANES, G_PAD]), axis=0) + w_in
    acc_g = tl.sum(tl.reshape(acc, [LANES, G_PAD, 2 * D2]) * w[:, :, None], axis=0) + w_in[:, None] * o_in
    out, lse = merge_finish(m_g, l_g, acc_g)                        # an empty run: 0, -inf
    o_row = out_ptr + split * stride_os + r_id.to(tl.int64) * stride_or + heads[:, None] * stride_oh + dd[None, :]
    l_row = lse_ptr + split * stride_ls + r_id.to(tl.int64) * stride_lr + heads
    tl.store(o_row, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    tl.store(l_row, lse, mask=g_ok)
    if NSPLIT > 1:
        if split == 0:
            p_o = o_row + NSPLIT * stride_os
            tl.store(p_o, tl.load(oin_row, mask=g_ok[:, None], other=0.0).to(tl.float32), mask=g_ok[:, None])
            tl.store(l_row + NSPLIT * stride_ls, tl.load(lin_row, mask=g_ok, other=float("-inf")), mask=g_ok)


def retro_attention_launch(q, k_cache, v_cache, block_ids, offsets, masks, picked, seq_of, entries, seen, cu,
                           out_in, lse_in, inv_freq, scale, *, cfg: RetroConfig = RetroConfig()):
    """Inputs checked by retro_attention_triton. Returns out [R, Hq, D] (q.dtype), lse [R, Hq] fp32, count int32
    [R, Hkv]."""
    n_rows, hq, dim = q.shape
    _, bs, hkv, _ = k_cache.shape
    k, width = picked.shape[2], seen.shape[2]
    group = hq // hkv
    g_pad = triton.next_power_of_2(group)
    nb = cfg.lanes or max(1, min(16 // g_pad, 64 // bs))
    split_cfg = AttendConfig(waves=cfg.waves, programs_per_sm=cfg.programs_per_sm, num_splits=cfg.num_splits)
    nsplit, per = pick_splits(split_cfg, n_rows, hkv, k, nb, q.device)
    if nsplit == 1:
        out = torch.empty_like(q)
        lse = torch.empty((n_rows, hq), dtype=torch.float32, device=q.device)
        o_strides, l_strides = (0, out.stride(0), out.stride(1)), (0, lse.stride(0))
    else:   # the splits' parts and the prior (part nsplit)
        out = torch.empty((nsplit + 1, n_rows, hq, dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((nsplit + 1, n_rows, hq), dtype=torch.float32, device=q.device)
        o_strides, l_strides = (out.stride(0), out.stride(1), out.stride(2)), (lse.stride(0), lse.stride(1))
    count = torch.empty((n_rows, hkv), dtype=torch.int32, device=q.device)
    pages = torch.empty((n_rows, hkv, max(k, 1)), dtype=torch.int32, device=q.device)   # scratch: the lists
    if n_rows:
        _retro_attention_kernel[(n_rows, hkv, nsplit)](
            q, k_cache, v_cache, block_ids, offsets, masks, inv_freq,
            picked, seq_of, entries, seen, cu, pages, count, out_in, lse_in, out, lse,
            float(scale) * LOG2E.value, per,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            picked.stride(0), picked.stride(1), seen.stride(0), seen.stride(1),
            out_in.stride(0), out_in.stride(1), lse_in.stride(0), *o_strides, *l_strides,
            K=k, K_PAD=triton.next_power_of_2(max(k, 1)), WIDTH=width, TILE=cfg.seen_tile,
            G=group, G_PAD=g_pad, NB=nb, ROWS=max(16, nb * g_pad), BS=bs, D2=dim // 2,
            DOT_F32=dot_f32(q.dtype), NSPLIT=nsplit, num_warps=cfg.num_warps, num_stages=cfg.num_stages or 1)
    if nsplit == 1:
        return out, lse, count
    merged, merged_lse = merge_rows(out.reshape(nsplit + 1, n_rows * hq, dim), lse.reshape(nsplit + 1, n_rows * hq),
                                    q.dtype, all_parts=nsplit + 1 > UNROLL_PARTS)
    return merged.reshape(n_rows, hq, dim), merged_lse.reshape(n_rows, hq), count


def _check_past(q, k_cache, v_cache, inv_freq, out_in) -> None:
    """The checks retro_attention and quest_retro_attention share: caches, a past query per row, its prior."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() \
            or k_cache.stride(3) != 1:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
                         "[N, BS, Hkv, D], with one set of strides and a contiguous head dimension")
    _check_query(q, k_cache.shape[3], inv_freq)
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} KV heads")
    if not q.dtype == k_cache.dtype == v_cache.dtype == out_in.dtype:
        raise ValueError(f"q, k_cache, v_cache and out_in dtypes differ: {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}, {out_in.dtype}")


def retro_attention_triton(q, k_cache, v_cache, block_ids, offsets, masks, picked, seq_of, entries, seen, cu, out_in,
                           lse_in, inv_freq, scale):
    """See kernels/sparse/retro.py's retro_attention: its inputs checked once, then one launch."""
    _check_past(q, k_cache, v_cache, inv_freq, out_in)
    n_rows, hq, _ = q.shape
    hkv = k_cache.shape[2]
    if picked.dim() != 3 or picked.shape[1] != hkv or seen.dim() != 3 or seen.shape[:2] != (n_rows, hkv):
        raise ValueError(f"sel {tuple(picked.shape)} must be [B, Hkv, K] and seen {tuple(seen.shape)} [R, Hkv, W] "
                         f"for {n_rows} rows and {hkv} KV heads")
    if seq_of.shape != (n_rows,) or entries.shape != (n_rows,) or cu.shape != (picked.shape[0] + 1,):
        raise ValueError(f"seq_of {tuple(seq_of.shape)}, entries {tuple(entries.shape)} must be [{n_rows}] and cu "
                         f"{tuple(cu.shape)} [{picked.shape[0] + 1}]")
    if out_in.shape != q.shape or lse_in.shape != q.shape[:2] or lse_in.dtype != torch.float32:
        raise ValueError(f"out_in {tuple(out_in.shape)} must be q's shape and lse_in {lse_in.dtype} "
                         f"{tuple(lse_in.shape)} fp32 [R, Hq]")
    block_ids, offsets, masks = _table(block_ids, offsets, masks)
    last = lambda t: t if t.stride(-1) == 1 else t.contiguous()     # noqa: E731
    return retro_attention_launch(
        last(q), k_cache, v_cache, block_ids, offsets, masks, picked.contiguous(), seq_of.contiguous(),
        entries.contiguous(), seen.contiguous(), cu.contiguous(), last(out_in), last(lse_in),
        inv_freq.to(device=q.device, dtype=torch.float32).contiguous(), scale)


# -- the current rows' sparse attention and their past rows' correction, in one read of the selected pages


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
    (fp32) at its index, and split 0 puts the priors (current rows: none) at part NSPLIT for merge_rows."""
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
    if NSPLIT == 1:   # the past rows' priors merged here (natural log; a prior of -inf weighs nothing)
        lse_in = tl.load(lin_row, mask=is_past, other=float("-inf"))
        o_in = tl.load(oin_row, mask=is_past[:, None], other=0.0).to(tl.float32)
        m = tl.maximum(lse, lse_in)
        m_s = tl.where(m == float("-inf"), 0.0, m)
        w_now = tl.exp(lse - m_s)
        w_in = tl.exp(lse_in - m_s)
        l_sum = w_now + w_in
        empty = l_sum == 0.0
        l_safe = tl.where(empty, 1.0, l_sum)
        out = (out * w_now[:, None] + o_in * w_in[:, None]) / l_safe[:, None]
        lse = tl.where(empty, float("-inf"), m_s + tl.log(l_safe))
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
    nb = cfg.lanes or max(1, min(16 // g_pad, 64 // bs))
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
        out, lse = merge_rows(out.reshape(nsplit + 1, total * hq, dim), lse.reshape(nsplit + 1, total * hq), q.dtype,
                              all_parts=nsplit + 1 > UNROLL_PARTS)
        out, lse = out.reshape(total, hq, dim), lse.reshape(total, hq)
    return out[:n_cur], lse[:n_cur], out[n_cur:], lse[n_cur:], count_past


def quest_retro_attention_triton(q, q_past, k_cache, v_cache, block_ids, offsets, masks, sel, count, entries, seen,
                                 cu, out_in, lse_in, inv_freq, scale):
    """See kernels/sparse/retro.py's quest_retro_attention: its inputs checked once, then one launch (two when the
    selection is split)."""
    _check_past(q_past, k_cache, v_cache, inv_freq, out_in)
    _check_query(q, k_cache.shape[3], inv_freq)
    n_cur, hq, _ = q.shape
    n_past, hkv = q_past.shape[0], k_cache.shape[2]
    if q.dtype != q_past.dtype or q.shape[1] != q_past.shape[1]:
        raise ValueError(f"q {q.dtype} {tuple(q.shape)} and q_past {q_past.dtype} {tuple(q_past.shape)} must share "
                         "a dtype and their heads")
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
