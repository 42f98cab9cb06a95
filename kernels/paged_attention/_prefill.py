"""Triton prefill attention over lazily rotated paged keys (see reference.py for the layout).

One program per (tile of BLOCK_T query tokens of one sequence, KV head). The tile's rows are
(token, group head) pairs, so all GQA heads of a KV head share each K/V tile it loads:
    row r -> token t0 + r // G_PAD, query head h * G + r % G_PAD      (BLOCK_M = BLOCK_T * G_PAD rows)
The loop walks the sequence's entries NB at a time (BLOCK_N = NB * BS keys). Each K tile is rotated
forward by its entries' offsets in fp32 (R_off R_local k = R_global k), cast back to the input
dtype and split in halves, so q.k = q1.k1' + q2.k2' is two dots of D/2 and no layout shuffle.
Causality compares global positions (offset + slot_pos <= q_pos), so queries may be scattered
anywhere in the context (CacheBlend's recomputed tokens), not only a suffix.

Tiles are found without a host sync: sequence b owns tile ids [cu_q[b] // BLOCK_T + b, ...), a
tile past the sequence's end does nothing. The grid is Tq // BLOCK_T + B tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.paged_attention._meta import PackedTable, dot_f32

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
INT32_MAX = tl.constexpr(2**31 - 1)


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    """Tile shape: BLOCK_M query rows (tokens x group heads), at least 64 keys per step."""

    block_m: int = 128
    min_block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self):
        if self.block_m < 16 or self.block_m & (self.block_m - 1):
            raise ValueError(f"block_m must be a power of two >= 16, got {self.block_m}")


@triton.jit
def _prefill_kernel(
    q_ptr, qpos_ptr, k_ptr, v_ptr, slotpos_ptr, meta_ptr, mask_ptr, tab_ptr, invf_ptr,
    cu_q_ptr, cu_e_ptr, out_ptr, lse_ptr,
    n_seqs, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
    stride_kb, stride_ks, stride_kh,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BS: tl.constexpr, NB: tl.constexpr,
    D2: tl.constexpr, B_PAD: tl.constexpr,
    ROTATE: tl.constexpr, USE_TABLE: tl.constexpr, MASK_IN_WORD: tl.constexpr, DOT_F32: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_T * G_PAD
    BLOCK_N: tl.constexpr = NB * BS
    tile = tl.program_id(0)
    h = tl.program_id(1)

    # which sequence owns this tile: the last b with cu_q[b] // BLOCK_T + b <= tile
    bi = tl.arange(0, B_PAD)
    starts = tl.load(cu_q_ptr + bi, mask=bi < n_seqs, other=0) // BLOCK_T + bi
    b = tl.sum(((starts <= tile) & (bi < n_seqs)).to(tl.int32), axis=0) - 1
    q_lo = tl.load(cu_q_ptr + b)
    q_hi = tl.load(cu_q_ptr + b + 1)
    t0 = q_lo + (tile - (q_lo // BLOCK_T + b)) * BLOCK_T
    e_lo = tl.load(cu_e_ptr + b)
    e_hi = tl.load(cu_e_ptr + b + 1)
    e_hi = tl.where(t0 < q_hi, e_hi, e_lo)  # a tile past the sequence's end loops zero times

    r = tl.arange(0, BLOCK_M)
    tok = t0 + r // G_PAD
    g = r % G_PAD
    row_ok = (tok < q_hi) & (g < G)
    head = h * G + g
    d = tl.arange(0, D2)
    dd = tl.arange(0, 2 * D2)
    q_row = q_ptr + tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q1 = tl.load(q_row + d[None, :], mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D2]
    q2 = tl.load(q_row + D2 + d[None, :], mask=row_ok[:, None], other=0.0)
    if DOT_F32:
        q1 = q1.to(tl.float32)
        q2 = q2.to(tl.float32)
    q_pos = tl.load(qpos_ptr + tok, mask=row_ok, other=-1)  # a padding row sees nothing
    if not ROTATE or not USE_TABLE:
        inv_freq = tl.load(invf_ptr + d)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, 2 * D2], tl.float32)
    n = tl.arange(0, BLOCK_N)
    slot = n % BS
    for e_start in range(e_lo, e_hi, NB):
        e = e_start + n // BS  # [BLOCK_N] entry of each key row
        e_ok = e < e_hi
        word = tl.load(meta_ptr + e, mask=e_ok, other=0)
        blk = word >> 32
        off = ((word >> 16) & 0xFFFF).to(tl.int32)
        if MASK_IN_WORD:
            bits = word
        else:
            bits = tl.load(mask_ptr + e, mask=e_ok, other=0)
        vis = (((bits >> slot) & 1) != 0) & e_ok
        k_pos = off + tl.load(slotpos_ptr + blk * BS + slot, mask=vis, other=0)
        k_pos = tl.where(vis, k_pos, INT32_MAX)
        k_row = blk * stride_kb + slot * stride_ks + h * stride_kh  # [BLOCK_N] int64
        k1 = tl.load(k_ptr + k_row[:, None] + d[None, :], mask=vis[:, None], other=0.0)  # [BLOCK_N, D2]
        k2 = tl.load(k_ptr + k_row[:, None] + D2 + d[None, :], mask=vis[:, None], other=0.0)
        if ROTATE:
            if USE_TABLE:
                tab_row = tab_ptr + e[:, None] * (2 * D2) + d[None, :]
                cos = tl.load(tab_row, mask=e_ok[:, None], other=1.0)
                sin = tl.load(tab_row + D2, mask=e_ok[:, None], other=0.0)
            else:
                ang = off.to(tl.float32)[:, None] * inv_freq[None, :]
                cos = tl.cos(ang)
                sin = tl.sin(ang)
            k1f = k1.to(tl.float32)
            k2f = k2.to(tl.float32)
            k1 = (k1f * cos - k2f * sin).to(k_ptr.dtype.element_ty)
            k2 = (k2f * cos + k1f * sin).to(k_ptr.dtype.element_ty)
        if DOT_F32:  # Triton's interpreter multiplies bf16 wrongly: give it fp32
            k1 = k1.to(tl.float32)
            k2 = k2.to(tl.float32)
        qk = tl.dot(q1, tl.trans(k1))
        qk = tl.dot(q2, tl.trans(k2), qk)  # [BLOCK_M, BLOCK_N] fp32
        qk = tl.where(k_pos[None, :] <= q_pos[:, None], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.math.exp2(qk - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + k_row[:, None] + dd[None, :], mask=vis[:, None], other=0.0)  # [BLOCK_N, D]
        acc = acc * alpha[:, None]
        if DOT_F32:
            acc = tl.dot(p, v.to(tl.float32), acc)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    o_row = out_ptr + tok.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(o_row + dd[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + tok.to(tl.int64) * stride_lt + head, lse, mask=row_ok)


def launch(q, q_pos, k_cache, v_cache, slot_pos, packed: PackedTable, cu_q, cu_entries, inv_freq, scale,
           *, rotate: bool = True, cfg: PrefillConfig = PrefillConfig()):
    """Run the prefill kernel on a packed table. Returns out [Tq, Hq, D] (q.dtype), lse [Tq, Hq] fp32."""
    t, hq, dim = q.shape
    _, bs, hkv, _ = k_cache.shape
    group = hq // hkv
    g_pad = triton.next_power_of_2(group)
    block_t = max(1, cfg.block_m // g_pad)
    n_seqs = cu_q.numel() - 1
    out = torch.empty_like(q)
    lse = torch.empty((t, hq), dtype=torch.float32, device=q.device)
    if t == 0:
        return out, lse
    grid = (t // block_t + n_seqs, hkv)
    _prefill_kernel[grid](
        q, q_pos, k_cache, v_cache, slot_pos, packed.meta, packed.masks,
        packed.table if packed.table is not None else packed.meta, inv_freq,
        cu_q, cu_entries, out, lse,
        n_seqs, float(scale) * LOG2E.value,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), lse.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        G=group, G_PAD=g_pad, BLOCK_T=block_t, BS=bs, NB=max(1, cfg.min_block_n // bs), D2=dim // 2,
        B_PAD=triton.next_power_of_2(n_seqs + 1),
        ROTATE=rotate, USE_TABLE=packed.table is not None, MASK_IN_WORD=packed.mask_in_word,
        DOT_F32=dot_f32(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse
