"""Triton sparse decode attention: each (row, KV head) attends only to the entries its selection names.

The decode kernel's scheme (kernels/paged_attention/_decode.py) over a selection instead of a sequence: one
program per (row, KV head, split) walks its run of sel[r, h, :count[r, h]] NB entries per step; the tl.dot rows
are (lane j, group head g) pairs, lane j attending only to the j-th entry of each step; the query is rotated
BACKWARDS by an entry's offset (from the original fp32 query) only when some lane's offset changes, so a run of
selected pages of one chunk rotates once. Only the selected pages' keys and values are read.

Rows are independent of sequences (a past query with its own selection is a row like any other). Splits cut
every (row, head) selection into NSPLIT equal runs; partials (fp32) are merged by kernels/lse_merge. The block
table is read as given (block_ids int32, offsets int32, masks int64): a step reads 16 bytes an entry besides
its keys, so no packed table is built.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lse_merge.triton import merge_rows
from kernels.paged_attention._decode import DecodeConfig, pick_splits
from kernels.paged_attention._meta import dot_f32

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _sparse_decode_kernel(
    q_ptr, k_ptr, v_ptr, ids_ptr, off_ptr, mask_ptr, sel_ptr, cnt_ptr, invf_ptr, out_ptr, lse_ptr,
    qk_scale,
    stride_qr, stride_qh, stride_kb, stride_ks, stride_kh, stride_sr, stride_sh, stride_cr,
    stride_os, stride_or, stride_oh, stride_ls, stride_lr,
    G: tl.constexpr, G_PAD: tl.constexpr, NB: tl.constexpr, ROWS: tl.constexpr, BS: tl.constexpr,
    D2: tl.constexpr, NSPLIT: tl.constexpr, DOT_F32: tl.constexpr,
):
    BLOCK_N: tl.constexpr = NB * BS
    r_id = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    n_sel = tl.load(cnt_ptr + r_id.to(tl.int64) * stride_cr + h)
    per = tl.cdiv(n_sel, NSPLIT)
    lo = split * per
    hi = tl.minimum(lo + per, n_sel)
    sel_row = sel_ptr + r_id.to(tl.int64) * stride_sr + h * stride_sh
    mask_lo_ptr = mask_ptr.to(tl.pointer_type(tl.int32))  # little-endian: word 2e is entry e's low 32 bits

    # row r = (lane j, group head g): lane j attends to the j-th selected entry of every step
    r = tl.arange(0, ROWS)
    j = r // G_PAD
    g = r % G_PAD
    row_ok = (j < NB) & (g < G)
    d = tl.arange(0, D2)
    dd = tl.arange(0, 2 * D2)
    q_row = q_ptr + r_id.to(tl.int64) * stride_qr + (h * G + g)[:, None] * stride_qh
    qr1 = tl.zeros([ROWS, D2], q_ptr.dtype.element_ty)
    qr2 = tl.zeros([ROWS, D2], q_ptr.dtype.element_ty)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, 2 * D2], tl.float32)
    n = tl.arange(0, BLOCK_N)
    slot = n % BS
    prev = tl.full([ROWS], -1, tl.int32)
    for k_start in range(lo, hi, NB):
        kk = k_start + n // BS  # [BLOCK_N] the selection slot of each key
        k_ok = kk < hi
        e = tl.load(sel_row + kk, mask=k_ok, other=0)
        blk = tl.load(ids_ptr + e, mask=k_ok, other=0).to(tl.int64)
        # the slot's bit from the 32-bit half of its int64 mask that holds it: with int64 [BLOCK_N] masks the kernel
        # compiled for sm_90 hit the 255-register cap (Triton 3.6), with int32 ones it needs 243
        bits = tl.load(mask_lo_ptr + 2 * e + slot // 32, mask=k_ok, other=0)
        vis = (((bits >> (slot % 32)) & 1) != 0) & k_ok
        k_row_sel = k_start + j
        e_row = tl.load(sel_row + k_row_sel, mask=k_row_sel < hi, other=0)  # [ROWS]
        off = tl.load(off_ptr + e_row, mask=k_row_sel < hi, other=0)
        if tl.max((off != prev).to(tl.int32), axis=0) > 0:  # a new chunk: rotate the original q back
            ang = off.to(tl.float32)[:, None] * tl.load(invf_ptr + d)[None, :]
            cos = tl.cos(ang)
            sin = tl.sin(ang)
            q1f = tl.load(q_row + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
            q2f = tl.load(q_row + D2 + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
            qr1 = (q1f * cos + q2f * sin).to(q_ptr.dtype.element_ty)
            qr2 = (q2f * cos - q1f * sin).to(q_ptr.dtype.element_ty)
            prev = off
        k_row = blk * stride_kb + slot * stride_ks + h * stride_kh  # [BLOCK_N] int64
        k1 = tl.load(k_ptr + k_row[:, None] + d[None, :], mask=vis[:, None], other=0.0)  # [BLOCK_N, D2]
        k2 = tl.load(k_ptr + k_row[:, None] + D2 + d[None, :], mask=vis[:, None], other=0.0)
        v = tl.load(v_ptr + k_row[:, None] + dd[None, :], mask=vis[:, None], other=0.0)  # [BLOCK_N, D]
        if DOT_F32:  # Triton's interpreter multiplies bf16 wrongly: give it fp32
            qk = tl.dot(qr1.to(tl.float32), tl.trans(k1.to(tl.float32)))
            qk = tl.dot(qr2.to(tl.float32), tl.trans(k2.to(tl.float32)), qk)
        else:
            qk = tl.dot(qr1, tl.trans(k1))
            qk = tl.dot(qr2, tl.trans(k2), qk)  # [ROWS, BLOCK_N]
        own = (j[:, None] == (n // BS)[None, :]) & vis[None, :]  # lane j sees only its own entry
        qk = tl.where(own, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if DOT_F32:
            acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new

    # merge the NB lanes of each group head by log-sum-exp
    m3 = tl.reshape(m_i, [ROWS // G_PAD, G_PAD])
    m_g = tl.max(m3, axis=0)  # [G_PAD]
    m_gs = tl.where(m_g == float("-inf"), 0.0, m_g)
    w = tl.math.exp2(m3 - m_gs[None, :])  # [lanes, G_PAD]
    l_g = tl.sum(w * tl.reshape(l_i, [ROWS // G_PAD, G_PAD]), axis=0)
    acc_g = tl.sum(tl.reshape(acc, [ROWS // G_PAD, G_PAD, 2 * D2]) * w[:, :, None], axis=0)  # [G_PAD, D]
    empty = l_g == 0.0
    l_safe = tl.where(empty, 1.0, l_g)
    out = acc_g / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_g + tl.math.log2(l_safe)) * LN2)
    gg = tl.arange(0, G_PAD)
    g_ok = gg < G
    o_row = out_ptr + split * stride_os + r_id.to(tl.int64) * stride_or + (h * G + gg)[:, None] * stride_oh
    tl.store(o_row + dd[None, :], out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    tl.store(lse_ptr + split * stride_ls + r_id.to(tl.int64) * stride_lr + h * G + gg, lse, mask=g_ok)


def launch(q, k_cache, v_cache, block_ids, offsets, masks, sel, count, inv_freq, scale,
           *, cfg: DecodeConfig = DecodeConfig()):
    """Inputs checked by triton.py. Returns out [R, Hq, D] (q.dtype), lse [R, Hq] fp32. Splits are picked from the
    selection's width K (no host sync: count is read by the kernel), as the decode kernel picks them from a
    sequence's entries."""
    n_rows, hq, dim = q.shape
    _, bs, hkv, _ = k_cache.shape
    group = hq // hkv
    g_pad = triton.next_power_of_2(group)
    nb = max(1, min(cfg.rows // g_pad, cfg.max_block_n // bs))  # lanes: fill the rows tl.dot needs
    nsplit = pick_splits(cfg, n_rows, hkv, n_rows * sel.shape[2], q.device)
    if nsplit == 1:
        out = torch.empty_like(q)
        lse = torch.empty((n_rows, hq), dtype=torch.float32, device=q.device)
        o_strides = (0, out.stride(0), out.stride(1))
        l_strides = (0, lse.stride(0))
    else:
        out = torch.empty((nsplit, n_rows, hq, dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((nsplit, n_rows, hq), dtype=torch.float32, device=q.device)
        o_strides = (out.stride(0), out.stride(1), out.stride(2))
        l_strides = (lse.stride(0), lse.stride(1))
    if n_rows:
        _sparse_decode_kernel[(n_rows, hkv, nsplit)](
            q, k_cache, v_cache, block_ids, offsets, masks, sel, count, inv_freq, out, lse,
            float(scale) * LOG2E.value,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            sel.stride(0), sel.stride(1), count.stride(0), *o_strides, *l_strides,
            G=group, G_PAD=g_pad, NB=nb, ROWS=max(16, nb * g_pad), BS=bs, D2=dim // 2, NSPLIT=nsplit,
            DOT_F32=dot_f32(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    if nsplit == 1:
        return out, lse
    merged, merged_lse = merge_rows(out.reshape(nsplit, n_rows * hq, dim), lse.reshape(nsplit, n_rows * hq), q.dtype)
    return merged.reshape(n_rows, hq, dim), merged_lse.reshape(n_rows, hq)
