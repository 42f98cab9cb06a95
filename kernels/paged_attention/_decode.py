"""Triton decode attention over lazily rotated paged keys (flash-decoding split-KV, LSE merge).

One program per (sequence, KV head, split). The program holds the whole GQA group as the rows of a
[G_PAD >= 16, D] query tile (tl.dot needs 16 rows; padding rows are zero) and walks its split of the
sequence's entries one block (BS keys) at a time. Instead of rotating every key forward by its
entry's offset it rotates the query backwards, once per change of offset (chunk boundaries):
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

from kernels.lse_merge.triton import merge_rows
from kernels.paged_attention._meta import PackedTable, dot_f32

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """num_splits None picks one so that about `waves` x SMs programs run, each with at least
    `min_blocks_per_split` blocks."""

    num_warps: int = 4
    num_stages: int = 3
    num_splits: int | None = None
    waves: int = 4
    min_blocks_per_split: int = 16

    def __post_init__(self):
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, meta_ptr, mask_ptr, tab_ptr, invf_ptr, cu_e_ptr, out_ptr, lse_ptr,
    qk_scale,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_os, stride_ob, stride_oh, stride_ls, stride_lb,
    G: tl.constexpr, G_PAD: tl.constexpr, BS: tl.constexpr, D2: tl.constexpr, NSPLIT: tl.constexpr,
    ROTATE: tl.constexpr, USE_TABLE: tl.constexpr, MASK_IN_WORD: tl.constexpr, DOT_F32: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    e_lo = tl.load(cu_e_ptr + b)
    e_hi = tl.load(cu_e_ptr + b + 1)
    per = tl.cdiv(e_hi - e_lo, NSPLIT)
    lo = e_lo + split * per
    hi = tl.minimum(lo + per, e_hi)

    g = tl.arange(0, G_PAD)
    g_ok = g < G
    head = h * G + g
    d = tl.arange(0, D2)
    dd = tl.arange(0, 2 * D2)
    q_row = q_ptr + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh
    q1 = tl.load(q_row + d[None, :], mask=g_ok[:, None], other=0.0)  # [G_PAD, D2]
    q2 = tl.load(q_row + D2 + d[None, :], mask=g_ok[:, None], other=0.0)
    qr1 = q1
    qr2 = q2
    q1f = q1.to(tl.float32)
    q2f = q2.to(tl.float32)
    if ROTATE and not USE_TABLE:
        inv_freq = tl.load(invf_ptr + d)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, 2 * D2], tl.float32)
    slot = tl.arange(0, BS)
    prev = -1
    for e in range(lo, hi):
        word = tl.load(meta_ptr + e)
        blk = word >> 32
        off = ((word >> 16) & 0xFFFF).to(tl.int32)
        if MASK_IN_WORD:
            bits = word
        else:
            bits = tl.load(mask_ptr + e)
        vis = ((bits >> slot) & 1) != 0  # [BS]
        if ROTATE:
            if off != prev:  # a new chunk: rotate the original query back by its offset
                if USE_TABLE:
                    cos = tl.load(tab_ptr + e * (2 * D2) + d)
                    sin = tl.load(tab_ptr + e * (2 * D2) + D2 + d)
                else:
                    ang = off.to(tl.float32) * inv_freq
                    cos = tl.cos(ang)
                    sin = tl.sin(ang)
                qr1 = (q1f * cos[None, :] + q2f * sin[None, :]).to(q_ptr.dtype.element_ty)
                qr2 = (q2f * cos[None, :] - q1f * sin[None, :]).to(q_ptr.dtype.element_ty)
                prev = off
        k_row = blk * stride_kb + slot * stride_ks + h * stride_kh  # [BS] int64
        k1 = tl.load(k_ptr + k_row[:, None] + d[None, :], mask=vis[:, None], other=0.0)  # [BS, D2]
        k2 = tl.load(k_ptr + k_row[:, None] + D2 + d[None, :], mask=vis[:, None], other=0.0)
        v = tl.load(v_ptr + k_row[:, None] + dd[None, :], mask=vis[:, None], other=0.0)  # [BS, D]
        if DOT_F32:  # Triton's interpreter multiplies bf16 wrongly: give it fp32
            qk = tl.dot(qr1.to(tl.float32), tl.trans(k1.to(tl.float32)))
            qk = tl.dot(qr2.to(tl.float32), tl.trans(k2.to(tl.float32)), qk)
        else:
            qk = tl.dot(qr1, tl.trans(k1))
            qk = tl.dot(qr2, tl.trans(k2), qk)
        qk = tl.where(vis[None, :], qk * qk_scale, float("-inf"))
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

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    o_row = out_ptr + split * stride_os + b.to(tl.int64) * stride_ob + head[:, None] * stride_oh
    tl.store(o_row + dd[None, :], out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    tl.store(lse_ptr + split * stride_ls + b * stride_lb + head, lse, mask=g_ok)


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def pick_splits(cfg: DecodeConfig, n_seqs: int, n_kv_heads: int, n_entries: int, device) -> int:
    """Splits per sequence from the mean entry count (block_ids.numel() is known without a sync)."""
    if cfg.num_splits is not None:
        return cfg.num_splits
    want = triton.cdiv(cfg.waves * _sm_count(device), max(1, n_seqs * n_kv_heads))
    most = max(1, (n_entries // max(1, n_seqs)) // cfg.min_blocks_per_split)
    return max(1, min(want, most))


def launch(q, k_cache, v_cache, packed: PackedTable, cu_entries, inv_freq, scale,
           *, rotate: bool = True, cfg: DecodeConfig = DecodeConfig()):
    """Run decode attention on a packed table. Returns out [B, Hq, D] (q.dtype), lse [B, Hq] fp32."""
    n_seqs, hq, dim = q.shape
    _, bs, hkv, _ = k_cache.shape
    group = hq // hkv
    nsplit = pick_splits(cfg, n_seqs, hkv, packed.meta.numel(), q.device)
    if nsplit == 1:
        out = torch.empty_like(q)
        lse = torch.empty((n_seqs, hq), dtype=torch.float32, device=q.device)
        o_strides = (0, out.stride(0), out.stride(1))
        l_strides = (0, lse.stride(0))
    else:
        out = torch.empty((nsplit, n_seqs, hq, dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((nsplit, n_seqs, hq), dtype=torch.float32, device=q.device)
        o_strides = (out.stride(0), out.stride(1), out.stride(2))
        l_strides = (lse.stride(0), lse.stride(1))
    if n_seqs:
        _decode_kernel[(n_seqs, hkv, nsplit)](
            q, k_cache, v_cache, packed.meta, packed.masks,
            packed.table if packed.table is not None else packed.meta, inv_freq, cu_entries, out, lse,
            scale * LOG2E,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            *o_strides, *l_strides,
            G=group, G_PAD=max(16, triton.next_power_of_2(group)), BS=bs, D2=dim // 2, NSPLIT=nsplit,
            ROTATE=rotate, USE_TABLE=packed.table is not None, MASK_IN_WORD=packed.mask_in_word,
            DOT_F32=dot_f32(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    if nsplit == 1:
        return out, lse
    merged, merged_lse = merge_rows(out.reshape(nsplit, n_seqs * hq, dim), lse.reshape(nsplit, n_seqs * hq), q.dtype)
    return merged.reshape(n_seqs, hq, dim), merged_lse.reshape(n_seqs, hq)
