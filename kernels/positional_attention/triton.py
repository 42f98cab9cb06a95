"""Positional attention, Triton (twin: reference.py).

One program per (tile of BLOCK_M // G query tokens, key head): its rows are the tile's tokens times the G
query heads that share the key head, so each key block is loaded once for all of them. It walks the key
blocks from position 0 up to the tile's latest query position (keys past it are never loaded) with an
online softmax in fp32 (exp2); only blocks that reach past the tile's earliest query position are masked.
Keys are contiguous [S, Hkv, D] (blend_tail.py gathers them, rotated, once a layer): no table, no slot
positions, no per-entry offset, so each step is two MMAs and the softmax.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.linear.tma import descriptor
from kernels.paged_attention._meta import dot_f32
from kernels.positional_attention.reference import check

LOG2E = 1.4426950408889634
# K and V through tensor descriptors on Hopper: 52.7 against 59.2 us by pointer loads for the engine's shape on an
# H100 (bench/positional_attention/README.md); False: pointer loads everywhere
TMA = True


@triton.jit
def _positional_kernel(q_ptr, pos_ptr, k_ptr, v_ptr, o_ptr, n_q, n_k, scale_log2, stride_qt, stride_qh, stride_kt,
                       stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                       k_desc, v_desc, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr, TMA: tl.constexpr,
                       DOT_F32: tl.constexpr):
    """EVEN: D == BLOCK_D and the key count a multiple of BLOCK_N (no load masks). TMA: K and V blocks through
    tensor descriptors (k_desc, v_desc over [S, Hkv * D]; keys past S come in as zeros)."""
    BLOCK_T: tl.constexpr = BLOCK_M // G
    kvh = tl.program_id(1)
    r = tl.arange(0, BLOCK_M)
    tok = tl.program_id(0) * BLOCK_T + r // G
    head = kvh * G + r % G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    row_ok = tok < n_q
    qp = tl.load(pos_ptr + tok, mask=row_ok, other=-1).to(tl.int32)
    q = tl.load(q_ptr + tok[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    hi = tl.minimum(tl.max(qp, 0) + 1, n_k)
    lo = tl.min(tl.where(row_ok & (qp >= 0), qp, 2147483647), 0)  # blocks wholly at or before it need no mask
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        kv_ok = n < n_k
        if TMA:
            k = k_desc.load([n0, kvh * D])
            v = v_desc.load([n0, kvh * D])
        elif EVEN:
            k = tl.load(k_ptr + n[:, None].to(tl.int64) * stride_kt + kvh * stride_kh + d[None, :])
            v = tl.load(v_ptr + n[:, None].to(tl.int64) * stride_vt + kvh * stride_vh + d[None, :])
        else:
            k = tl.load(k_ptr + n[:, None].to(tl.int64) * stride_kt + kvh * stride_kh + d[None, :],
                        mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(v_ptr + n[:, None].to(tl.int64) * stride_vt + kvh * stride_vh + d[None, :],
                        mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_F32:  # Triton's interpreter multiplies bf16 wrongly: give it fp32
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * scale_log2
        else:
            s = tl.dot(q, tl.trans(k)) * scale_log2
        if (n0 + BLOCK_N - 1 > lo) | (n0 + BLOCK_N > n_k):
            s = tl.where((n[None, :] <= qp[:, None]) & kv_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_F32:
            acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc * alpha[:, None])
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out = tl.where((qp >= 0)[:, None], out, 0.0)  # a query at a negative position sees no key (its unmasked blocks did)
    tl.store(o_ptr + tok[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def config(n_q: int, group: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): 64 query rows (16 tokens of a 4-head group) a program, 64 keys a
    step, 3 stages. On an H100, for 528 rows over 3,200 keys (bench/positional_attention/positional_attention.py,
    positional_attention_s10d.json, K and V by TMA): 52.7 us; the 11 other tiles measured 56.5-129 us (128-row
    tiles, 128-key steps, 2 or 4 stages, 8 warps, 32-row tiles, 32-key steps). Splitting each tile's keys over
    several programs and merging the parts (measured at commit 4dc081a, positional_attention_s10c.json) was
    slower: 68-88 against 62 us."""
    block_m = max(16, min(64, triton.next_power_of_2(max(1, n_q) * group)))
    return block_m, 64, 4, 3


def _tma_ok(k: torch.Tensor, v: torch.Tensor, dim: int, block_n: int) -> bool:
    """Whether K and V can be read through tensor descriptors: Hopper (or the interpreter), [S, Hkv * D] rows with
    16-byte aligned bases and row strides, a power-of-2 head_dim, boxes within TMA's 256 a dimension."""
    if k.device.type == "cuda":
        if torch.cuda.get_device_capability(k.device)[0] < 9:
            return False
    elif os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    if dim & (dim - 1) or max(dim, block_n) > 256:
        return False
    for t in (k, v):
        if t.stride(1) != dim or (t.data_ptr() % 16) or (t.stride(0) * t.element_size()) % 16:
            return False
    return True


def positional_attention(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         cfg: tuple[int, int, int, int] | None = None, tma: bool | None = None) -> torch.Tensor:
    """As reference.positional_attention. ``cfg``: (BLOCK_M, BLOCK_N, num_warps, num_stages), else ``config``'s;
    BLOCK_M a multiple of the group size G = Hq // Hkv, which must be a power of 2. ``tma``: K and V through
    tensor descriptors where they can be (None: the module's TMA switch). No host sync."""
    check(q, q_pos, k, v)
    n_q, n_heads, dim = q.shape
    group = n_heads // k.shape[1]
    if group & (group - 1):
        raise ValueError(f"the Triton kernel needs a power-of-2 query-per-key head group, got {group}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(2) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    block_m, block_n, warps, stages = cfg or config(n_q, group)
    if block_m % group:
        raise ValueError(f"BLOCK_M {block_m} is not a multiple of the head group {group}")
    out = torch.empty_like(q)
    if n_q == 0:
        return out
    block_d = max(16, triton.next_power_of_2(dim))
    use_tma = (TMA if tma is None else tma) and _tma_ok(k, v, dim, block_n)
    if use_tma:
        kd, vd = (descriptor(t.view(t.shape[0], -1), t.shape[0], (block_n, dim)) for t in (k, v))
    else:
        kd = vd = None
    grid = (triton.cdiv(n_q, block_m // group), k.shape[1])
    _positional_kernel[grid](q, q_pos, k, v, out, n_q, k.shape[0], scale * LOG2E, q.stride(0), q.stride(1),
                             k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1), kd, vd,
                             G=group, D=dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
                             EVEN=block_d == dim and k.shape[0] % block_n == 0, TMA=use_tma,
                             DOT_F32=dot_f32(q.dtype), num_warps=warps, num_stages=stages)
    return out
