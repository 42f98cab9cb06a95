"""Triton forms of kernels/sparse/retro.py: ``new_pages`` and ``retro_attention``.

Both run one program per (past row, KV head) and start alike (``_unseen``): the row's candidate pages (its
sequence's selection now) are tested against the pages it has seen, tile by tile, and the new ones get their ranks
by a prefix sum. ``new_pages`` stores them compacted. ``retro_attention`` stores them to a scratch list, attends
the row's query to them as kernels/sparse/_attend.py does (its table reads, its deferred rotation, the shared
online-softmax tile), and merges the result with the row's prior output by log-sum-exp before storing: one launch
a layer for what was a page-set kernel, a sparse attention (one or two launches), two stacks and a merge.

NOTE: one program per (row, KV head) and no split: a past row's new pages are few (often 0-30% of the budget), so
its walk is short; splits would need a merge of their partials, i.e. a second launch or a semaphore.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.lse_merge.triton import merge_finish
from kernels.paged_attention._decode import attend_tile
from kernels.paged_attention._meta import dot_f32
from kernels.sparse._attend import LOG2E, _rotate, _step_table
from kernels.sparse.triton import _check_query, _table

SEEN_TILE = 64


@dataclass(frozen=True, slots=True)
class RetroConfig:
    """Launch shape of ``retro_attention``. lanes: entries a step (None: _attend's, 16 tl.dot rows' worth, at most
    64 keys); num_warps as _attend measured best (8); seen_tile: seen pages tested at once."""

    # NOTE: no software pipelining by default: _attend's sweep (bench/decode/sparse_kernels.py) found 3 stages
    # 5-11% faster from 4 steps a program on and up to 84% slower at one or two, and most past rows walk few steps
    num_warps: int = 8
    num_stages: int = 1
    lanes: int | None = None
    # NOTE: 16, not new_pages' 64: at the Llama-3-8B shapes (budget 128 pages) the sm_90 build (Triton 3.9,
    # tests/kernels/compile_sm90.py's compile_kernel) takes 255 registers and spills 32 B with 64, 255 with 32,
    # 242 with 16
    seen_tile: int = 16

    def __post_init__(self):
        if self.lanes is not None and (self.lanes < 1 or self.lanes & (self.lanes - 1)):
            raise ValueError(f"lanes must be a power of two, got {self.lanes}")
        if self.seen_tile < 1 or self.seen_tile & (self.seen_tile - 1):
            raise ValueError(f"seen_tile must be a power of two, got {self.seen_tile}")


@triton.jit
def _unseen(pick_ptr, seq_ptr, ent_ptr, seen_ptr, cu_ptr, width, r, h, s_pb, s_ph, s_sr, s_sh,
            K: tl.constexpr, K_PAD: tl.constexpr, TILE: tl.constexpr):
    """Row r's candidates for KV head h: picked [K_PAD] (global entry indices, -1 past the selection), new [K_PAD]
    (existed at its step, not seen), each new one's rank pos [K_PAD] and their count."""
    b = tl.load(seq_ptr + r).to(tl.int64)
    start = tl.load(cu_ptr + b).to(tl.int64)
    kk = tl.arange(0, K_PAD)
    picked = tl.load(pick_ptr + b * s_pb + h * s_ph + kk, mask=kk < K, other=-1).to(tl.int64)
    cand = tl.where(picked >= 0, picked - start, -1)                 # within the sequence
    limit = tl.load(ent_ptr + r).to(tl.int64)
    new = (cand >= 0) & (cand < limit)
    seen_row = seen_ptr + r.to(tl.int64) * s_sr + h * s_sh
    for w0 in range(0, width, TILE):
        ww = w0 + tl.arange(0, TILE)
        s = tl.load(seen_row + ww, mask=ww < width, other=-1).to(tl.int64)
        hit = tl.max((cand[:, None] == s[None, :]).to(tl.int32), axis=1)
        new = new & (hit == 0)
    take = new.to(tl.int32)
    return picked, new, tl.cumsum(take, axis=0) - take, tl.sum(take, axis=0)


@triton.jit
def _new_pages_kernel(pick_ptr, seq_ptr, ent_ptr, seen_ptr, cu_ptr, sel_ptr, cnt_ptr, width,
                      s_pb, s_ph, s_sr, s_sh, s_or, s_oh,
                      K: tl.constexpr, K_PAD: tl.constexpr, TILE: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    picked, new, pos, count = _unseen(pick_ptr, seq_ptr, ent_ptr, seen_ptr, cu_ptr, width, r, h, s_pb, s_ph, s_sr,
                                      s_sh, K, K_PAD, TILE)
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
            picked, seq_of, entries, seen, cu, sel, count, w,
            picked.stride(0), picked.stride(1), seen.stride(0), seen.stride(1), sel.stride(0), sel.stride(1),
            K=k, K_PAD=triton.next_power_of_2(max(k, 1)), TILE=SEEN_TILE)
    return sel, count


@triton.jit
def _retro_attention_kernel(
    q_ptr, k_ptr, v_ptr, ids_ptr, off_ptr, mask_ptr, invf_ptr,
    pick_ptr, seq_ptr, ent_ptr, seen_ptr, cu_ptr, list_ptr, cnt_ptr,
    oin_ptr, lin_ptr, out_ptr, lse_ptr,
    qk_scale, width,
    stride_qr, stride_qh, stride_kb, stride_ks, stride_kh, s_pb, s_ph, s_sr, s_sh,
    stride_ir, stride_ih, stride_jr, stride_or, stride_oh, stride_lr,
    K: tl.constexpr, K_PAD: tl.constexpr, TILE: tl.constexpr,
    G: tl.constexpr, G_PAD: tl.constexpr, NB: tl.constexpr, ROWS: tl.constexpr, BS: tl.constexpr,
    D2: tl.constexpr, DOT_F32: tl.constexpr,
):
    BLOCK_N: tl.constexpr = NB * BS
    LANES: tl.constexpr = ROWS // G_PAD
    r_id = tl.program_id(0)
    h = tl.program_id(1)
    picked, new, pos, n_sel = _unseen(pick_ptr, seq_ptr, ent_ptr, seen_ptr, cu_ptr, width, r_id, h, s_pb, s_ph,
                                      s_sr, s_sh, K, K_PAD, TILE)
    row = r_id.to(tl.int64) * tl.num_programs(1) + h
    sel_row = list_ptr + row * K                                    # the compacted new pages, [K] (scratch)
    tl.store(sel_row + pos, picked.to(tl.int32), mask=new)
    tl.store(cnt_ptr + row, n_sel)
    # NOTE: the list is read back below by other threads than those that wrote it: a barrier between
    tl.debug_barrier()
    mask_lo_ptr = mask_ptr.to(tl.pointer_type(tl.int32))          # little-endian: word 2e is entry e's low 32 bits

    # as _attend: row r = (lane j, group head g), lane j attends to the j-th new page of every step
    r = tl.arange(0, ROWS)
    j = r // G_PAD
    g = r % G_PAD
    row_ok = (j < NB) & (g < G)
    d = tl.arange(0, D2)
    dd = tl.arange(0, 2 * D2)
    q_row = q_ptr + r_id.to(tl.int64) * stride_qr + (h * G + g)[:, None] * stride_qh

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, 2 * D2], tl.float32)
    n = tl.arange(0, BLOCK_N)
    slot = n % BS
    blk, bits, off = _step_table(sel_row, ids_ptr, mask_lo_ptr, off_ptr, 0, n_sel, n, slot, j, BS)
    qr1, qr2 = _rotate(q_row, off, invf_ptr, d, row_ok, ROWS, G_PAD, D2)
    prev = off
    for k_start in range(0, n_sel, NB):
        vis = ((bits >> (slot % 32)) & 1) != 0
        k_row = blk.to(tl.int64) * stride_kb + slot * stride_ks + h * stride_kh  # [BLOCK_N] int64
        k1 = tl.load(k_ptr + k_row[:, None] + d[None, :], mask=vis[:, None], other=0.0)  # [BLOCK_N, D2]
        k2 = tl.load(k_ptr + k_row[:, None] + D2 + d[None, :], mask=vis[:, None], other=0.0)
        v = tl.load(v_ptr + k_row[:, None] + dd[None, :], mask=vis[:, None], other=0.0)  # [BLOCK_N, D]
        blk, bits, off = _step_table(sel_row, ids_ptr, mask_lo_ptr, off_ptr, k_start + NB, n_sel, n, slot, j, BS)
        own = (j[:, None] == (n // BS)[None, :]) & vis[None, :]
        m_i, l_i, acc = attend_tile(qr1, qr2, k1, k2, v, own, qk_scale, m_i, l_i, acc, DOT_F32)
        if (k_start + NB < n_sel) & (tl.max((off != prev).to(tl.int32), axis=0) > 0):
            qr1, qr2 = _rotate(q_row, off, invf_ptr, d, row_ok, ROWS, G_PAD, D2)
            prev = off

    # per group head, the LANES lanes and the prior output (a part of weight exp(lse_in)) merged by log-sum-exp
    gg = tl.arange(0, G_PAD)
    g_ok = gg < G
    heads = h * G + gg
    lse_in = tl.load(lin_ptr + r_id.to(tl.int64) * stride_jr + heads, mask=g_ok, other=float("-inf")) * LOG2E
    o_in = tl.load(oin_ptr + r_id.to(tl.int64) * stride_ir + heads[:, None] * stride_ih + dd[None, :],
                   mask=g_ok[:, None], other=0.0).to(tl.float32)    # [G_PAD, D]
    m3 = tl.reshape(m_i, [LANES, G_PAD])
    m_g = tl.maximum(tl.max(m3, axis=0), lse_in)                    # [G_PAD], log2 units
    m_gs = tl.where(m_g == float("-inf"), 0.0, m_g)
    w = tl.math.exp2(m3 - m_gs[None, :])                            # [LANES, G_PAD]
    w_in = tl.math.exp2(lse_in - m_gs)
    l_g = tl.sum(w * tl.reshape(l_i, [LANES, G_PAD]), axis=0) + w_in
    acc_g = tl.sum(tl.reshape(acc, [LANES, G_PAD, 2 * D2]) * w[:, :, None], axis=0) + w_in[:, None] * o_in
    out, lse = merge_finish(m_g, l_g, acc_g)
    o_row = out_ptr + r_id.to(tl.int64) * stride_or + heads[:, None] * stride_oh
    tl.store(o_row + dd[None, :], out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    tl.store(lse_ptr + r_id.to(tl.int64) * stride_lr + heads, lse, mask=g_ok)


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
    out = torch.empty_like(q)
    lse = torch.empty((n_rows, hq), dtype=torch.float32, device=q.device)
    count = torch.empty((n_rows, hkv), dtype=torch.int32, device=q.device)
    pages = torch.empty((n_rows, hkv, max(k, 1)), dtype=torch.int32, device=q.device)   # scratch: the lists
    if n_rows:
        _retro_attention_kernel[(n_rows, hkv)](
            q, k_cache, v_cache, block_ids, offsets, masks, inv_freq,
            picked, seq_of, entries, seen, cu, pages, count, out_in, lse_in, out, lse,
            float(scale) * LOG2E.value, width,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            picked.stride(0), picked.stride(1), seen.stride(0), seen.stride(1),
            out_in.stride(0), out_in.stride(1), lse_in.stride(0), out.stride(0), out.stride(1), lse.stride(0),
            K=k, K_PAD=triton.next_power_of_2(max(k, 1)), TILE=cfg.seen_tile,
            G=group, G_PAD=g_pad, NB=nb, ROWS=max(16, nb * g_pad), BS=bs, D2=dim // 2,
            DOT_F32=dot_f32(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out, lse, count


def retro_attention_triton(q, k_cache, v_cache, block_ids, offsets, masks, picked, seq_of, entries, seen, cu, out_in,
                           lse_in, inv_freq, scale):
    """See kernels/sparse/retro.py's retro_attention: its inputs checked once, then one launch."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() \
            or k_cache.stride(3) != 1:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
                         "[N, BS, Hkv, D], with one set of strides and a contiguous head dimension")
    _check_query(q, k_cache.shape[3], inv_freq)
    n_rows, hq, _ = q.shape
    hkv = k_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    if not q.dtype == k_cache.dtype == v_cache.dtype == out_in.dtype:
        raise ValueError(f"q, k_cache, v_cache and out_in dtypes differ: {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}, {out_in.dtype}")
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
