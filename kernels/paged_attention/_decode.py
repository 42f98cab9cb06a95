"""Triton decode attention over lazily rotated paged keys (flash-decoding split-KV, LSE merge).

One program per (sequence, KV head, split) walks its run of the sequence's entries NB blocks per
step (BLOCK_N = NB * BS keys). tl.dot needs 16 query rows and a GQA group has only G, so the rows
are (lane j, group head g) pairs, ROWS = max(16, NB * G_PAD): lane j attends only to the j-th block
of each step (the other blocks are masked in its scores). Each lane is an independent online
softmax over its share of the keys; the NB lanes of a head are merged by log-sum-exp at the end.
The padding that tl.dot forces anyway is spent on lanes, so a step moves NB blocks instead of one.

Instead of rotating every key forward by its entry's offset, each lane's query is rotated
backwards, once per change of offset (chunk boundaries), never per block:
    (R_m q) . (R_{o+j} k) == (R_{m-o} q) . (R_j k)
always from the ORIGINAL fp32 query (no error accumulates), cast to the input dtype before the dot.

Splits: every sequence is cut into NSPLIT equal runs of its own entries (no host sync needed to
know the lengths); the partial results (fp32, normalised) and their LSE are merged by
kernels/lse_merge. With NSPLIT == 1 the kernel writes the final output directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.lse_merge.triton import merge_attention
from kernels.paged_attention._meta import ID_SHIFT_C, OFFSET_MASK_C, OFFSET_SHIFT_C, PackedTable, dot_f32, sm_count

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Launch shape. Lanes per step: rows // G_PAD blocks, at most max_block_n keys. num_splits None
    picks one (at most `waves` waves of programs, each with at least `min_blocks_per_split` blocks) whose
    last wave is fullest."""

    num_warps: int = 4
    num_stages: int = 3
    max_block_n: int = 64
    rows: int = 16
    num_splits: int | None = None
    waves: int = 4
    programs_per_sm: int = 3  # measured: 166 registers x 128 threads -> 3 resident programs
    min_blocks_per_split: int = 16

    def __post_init__(self):
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")


@triton.jit
def attend_tile(qr1, qr2, k1, k2, v, own, qk_scale, m_i, l_i, acc, DOT_F32: tl.constexpr):
    """One tile of keys into a running online softmax: the rotated query halves qr1, qr2 [ROWS, D/2] against the
    key halves k1, k2 [BLOCK_N, D/2] and values v [BLOCK_N, D], where ``own`` [ROWS, BLOCK_N] lets a row see a key;
    m_i (running max, log2 units), l_i (sum of weights) [ROWS] and acc [ROWS, D] updated. Dense and sparse decode
    (kernels/sparse/_attend.py) share it."""
    if DOT_F32:  # Triton's interpreter multiplies bf16 wrongly: give it fp32
        qk = tl.dot(qr1.to(tl.float32), tl.trans(k1.to(tl.float32)))
        qk = tl.dot(qr2.to(tl.float32), tl.trans(k2.to(tl.float32)), qk)
    else:
        qk = tl.dot(qr1, tl.trans(k1))
        qk = tl.dot(qr2, tl.trans(k2), qk)  # [ROWS, BLOCK_N]
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
    return m_new, l_i, acc


@triton.jit
def merge_lanes(m_i, l_i, acc, ROWS: tl.constexpr, G_PAD: tl.constexpr, D2: tl.constexpr):
    """The running softmaxes of ROWS // G_PAD lanes of each of G_PAD group heads (rows (lane, head), ``attend_tile``'s
    m_i, l_i [ROWS], acc [ROWS, D]) merged by log-sum-exp: out [G_PAD, D] fp32 and lse [G_PAD] (natural log; 0 and
    -inf for a head no lane saw a key of). Dense and sparse decode share it."""
    m3 = tl.reshape(m_i, [ROWS // G_PAD, G_PAD])
    m_g = tl.max(m3, axis=0)  # [G_PAD]
    m_gs = tl.where(m_g == float("-inf"), 0.0, m_g)
    w = tl.math.exp2(m3 - m_gs[None, :])  # [lanes, G_PAD]
    l_g = tl.sum(w * tl.reshape(l_i, [ROWS // G_PAD, G_PAD]), axis=0)
    acc_g = tl.sum(tl.reshape(acc, [ROWS // G_PAD, G_PAD, 2 * D2]) * w[:, :, None], axis=0)  # [G_PAD, D]
    empty = l_g == 0.0
    l_safe = tl.where(empty, 1.0, l_g)
    return acc_g / l_safe[:, None], tl.where(empty, float("-inf"), (m_g + tl.math.log2(l_safe)) * LN2)


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, meta_ptr, mask_ptr, tab_ptr, invf_ptr, cu_e_ptr, out_ptr, lse_ptr,
    qk_scale,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_os, stride_ob, stride_oh, stride_ls, stride_lb,
    G: tl.constexpr, G_PAD: tl.constexpr, NB: tl.constexpr, ROWS: tl.constexpr, BS: tl.constexpr,
    D2: tl.constexpr, NSPLIT: tl.constexpr,
    ROTATE: tl.constexpr, USE_TABLE: tl.constexpr, MASK_IN_WORD: tl.constexpr, DOT_F32: tl.constexpr,
):
    BLOCK_N: tl.constexpr = NB * BS
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    e_lo = tl.load(cu_e_ptr + b)
    e_hi = tl.load(cu_e_ptr + b + 1)
    per = tl.cdiv(e_hi - e_lo, NSPLIT)
    lo = e_lo + split * per
    hi = tl.minimum(lo + per, e_hi)

    # row r = (lane j, group head g): lane j attends to the j-th block of every step
    r = tl.arange(0, ROWS)
    j = r // G_PAD
    g = r % G_PAD
    row_ok = (j < NB) & (g < G)
    head = h * G + g
    d = tl.arange(0, D2)
    dd = tl.arange(0, 2 * D2)
    q_row = q_ptr + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh
    q1 = tl.load(q_row + d[None, :], mask=row_ok[:, None], other=0.0)  # [ROWS, D2]
    q2 = tl.load(q_row + D2 + d[None, :], mask=row_ok[:, None], other=0.0)
    qr1 = q1
    qr2 = q2
    if ROTATE and not USE_TABLE:
        inv_freq = tl.load(invf_ptr + d)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, 2 * D2], tl.float32)
    n = tl.arange(0, BLOCK_N)
    slot = n % BS
    prev = tl.full([ROWS], -1, tl.int32)
    for e_start in range(lo, hi, NB):
        e = e_start + n // BS  # [BLOCK_N] entry of each key
        e_ok = e < hi
        word = tl.load(meta_ptr + e, mask=e_ok, other=0)
        blk = word >> ID_SHIFT_C
        if MASK_IN_WORD:
            bits = word
        else:
            bits = tl.load(mask_ptr + e, mask=e_ok, other=0)
        vis = (((bits >> slot) & 1) != 0) & e_ok
        if ROTATE:
            e_row = e_start + j
            off = ((tl.load(meta_ptr + e_row, mask=e_row < hi, other=0) >> OFFSET_SHIFT_C) & OFFSET_MASK_C).to(tl.int32)  # [ROWS]
            if tl.max((off != prev).to(tl.int32), axis=0) > 0:  # a new chunk: rotate the original q back
                if USE_TABLE:
                    t_row = tab_ptr + e_row[:, None] * (2 * D2) + d[None, :]
                    cos = tl.load(t_row, mask=(e_row < hi)[:, None], other=1.0)
                    sin = tl.load(t_row + D2, mask=(e_row < hi)[:, None], other=0.0)
                else:
                    ang = off.to(tl.float32)[:, None] * inv_freq[None, :]
                    cos = tl.cos(ang)
                    sin = tl.sin(ang)
                # re-read the original query (L1/L2) rather than keep fp32 copies live: fewer
                # registers, more programs per SM
                q1f = tl.load(q_row + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
                q2f = tl.load(q_row + D2 + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
                qr1 = (q1f * cos + q2f * sin).to(q_ptr.dtype.element_ty)
                qr2 = (q2f * cos - q1f * sin).to(q_ptr.dtype.element_ty)
                prev = off
        k_row = blk * stride_kb + slot * stride_ks + h * stride_kh  # [BLOCK_N] int64
        k1 = tl.load(k_ptr + k_row[:, None] + d[None, :], mask=vis[:, None], other=0.0)  # [BLOCK_N, D2]
        k2 = tl.load(k_ptr + k_row[:, None] + D2 + d[None, :], mask=vis[:, None], other=0.0)
        v = tl.load(v_ptr + k_row[:, None] + dd[None, :], mask=vis[:, None], other=0.0)  # [BLOCK_N, D]
        own = (j[:, None] == (n // BS)[None, :]) & vis[None, :]  # lane j sees only its own block
        m_i, l_i, acc = attend_tile(qr1, qr2, k1, k2, v, own, qk_scale, m_i, l_i, acc, DOT_F32)

    out, lse = merge_lanes(m_i, l_i, acc, ROWS, G_PAD, D2)   # the lanes of each group head, by log-sum-exp
    gg = tl.arange(0, G_PAD)
    g_ok = gg < G
    o_row = out_ptr + split * stride_os + b.to(tl.int64) * stride_ob + (h * G + gg)[:, None] * stride_oh
    tl.store(o_row + dd[None, :], out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    tl.store(lse_ptr + split * stride_ls + b * stride_lb + h * G + gg, lse, mask=g_ok)


def pick_splits(cfg: DecodeConfig, n_seqs: int, n_kv_heads: int, n_entries: int, device) -> int:
    """Splits per sequence (block_ids.numel() is known without a sync). Programs run in waves of
    SMs x programs_per_sm; a last wave that is nearly empty costs a whole wave
    (bench/kernels/README.md: 7 splits ran 29% slower than 5 at 8 x 32K), so take the split count whose
    last wave is fullest, and the smallest such count."""
    if cfg.num_splits is not None:
        return cfg.num_splits
    base = max(1, n_seqs * n_kv_heads)
    most = max(1, (n_entries // max(1, n_seqs)) // cfg.min_blocks_per_split)
    slots = sm_count(device) * cfg.programs_per_sm
    most = min(most, max(1, triton.cdiv(cfg.waves * slots, base)))
    fill = lambda s: (base * s / slots) / triton.cdiv(base * s, slots)  # noqa: E731
    return max(range(1, most + 1), key=lambda s: (round(fill(s), 2), -s))


def split_outputs(q: torch.Tensor, nsplit: int):
    """Where a decode kernel of ``nsplit`` splits writes for queries q [R, Hq, D]: (out, lse, out strides, lse
    strides). One split: the final out (q's dtype) and lse [R, Hq] (a split stride of 0); several: fp32 parts
    [nsplit, R, Hq, D] and [nsplit, R, Hq] for kernels/lse_merge."""
    rows, hq, dim = q.shape
    if nsplit == 1:
        out = torch.empty_like(q)
        lse = torch.empty((rows, hq), dtype=torch.float32, device=q.device)
        return out, lse, (0, out.stride(0), out.stride(1)), (0, lse.stride(0))
    out = torch.empty((nsplit, rows, hq, dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((nsplit, rows, hq), dtype=torch.float32, device=q.device)
    return out, lse, (out.stride(0), out.stride(1), out.stride(2)), (lse.stride(0), lse.stride(1))


def launch(q, k_cache, v_cache, packed: PackedTable, cu_entries, inv_freq, scale,
           *, rotate: bool = True, cfg: DecodeConfig = DecodeConfig()):
    """Run decode attention on a packed table. Returns out [B, Hq, D] (q.dtype), lse [B, Hq] fp32."""
    n_seqs, hq, dim = q.shape
    _, bs, hkv, _ = k_cache.shape
    group = hq // hkv
    g_pad = triton.next_power_of_2(group)
    nb = max(1, min(cfg.rows // g_pad, cfg.max_block_n // bs))  # lanes: fill the rows tl.dot needs
    nsplit = pick_splits(cfg, n_seqs, hkv, packed.meta.numel(), q.device)
    out, lse, o_strides, l_strides = split_outputs(q, nsplit)
    if n_seqs:
        _decode_kernel[(n_seqs, hkv, nsplit)](
            q, k_cache, v_cache, packed.meta, packed.masks,
            packed.table if packed.table is not None else packed.meta, inv_freq, cu_entries, out, lse,
            float(scale) * LOG2E.value,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            *o_strides, *l_strides,
            G=group, G_PAD=g_pad, NB=nb, ROWS=max(16, nb * g_pad), BS=bs, D2=dim // 2, NSPLIT=nsplit,
            ROTATE=rotate, USE_TABLE=packed.table is not None, MASK_IN_WORD=packed.mask_in_word,
            DOT_F32=dot_f32(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    if nsplit == 1:
        return out, lse
    return merge_attention(out, lse, q.dtype)     # (past the unrolled merge's parts, every part loaded at once)
