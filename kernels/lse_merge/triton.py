"""Merge partial attention results by log-sum-exp, Triton (twin: reference.py).

One program per BLOCK_R rows walks the P parts once with an online max:
    m = max_i lse_i,  l = sum_i exp(lse_i - m),  out = sum_i exp(lse_i - m) out_i / l,  lse = m + log l.
A part with lse -inf adds nothing; a row no part saw gets out 0 and lse -inf.
With kernels/pdl.py's switch on (sm_90+), a programmatic dependent launch: each program waits for the kernel
before (griddepcontrol.wait, the partials' writer) before its first read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import enter as pdl_enter

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
BLOCK_R = 16
UNROLL_PARTS = 16  # part counts up to this compile a kernel of their own with the loop unrolled (the KV splits'
# counts: a handful of distinct values), on half as many rows a program: every part's tile is in flight at once
UNROLLED_BLOCK_R = 8
# parts one program of _merge_all_kernel takes (every part of a row at once); more parts loop. A dense decode at 32K,
# batch 1 splits each KV head 99 ways on an H100: the loop over them took 66.9 us against the attention's 58.5
# (bench/decode/README.md)
MAX_ALL_PARTS = 128


@triton.jit
def _merge_kernel(outs_ptr, lses_ptr, out_ptr, lse_ptr, n_parts, n_rows, dim,
                  stride_op, stride_or, stride_lp,
                  BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
                  N_PARTS: tl.constexpr = 0):
    """N_PARTS > 0: the part count is known at compile time and the loop unrolled, so the parts' loads need
    not wait for each other's arithmetic (a loop over a runtime count issues one part's loads at a time)."""
    if PDL:
        pdl_enter(PDL)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    r_ok = r < n_rows
    ok = r_ok[:, None] & (d[None, :] < dim)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    if N_PARTS > 0:
        for p in tl.static_range(N_PARTS):
            m, l, acc = _merge_part(m, l, acc, p, outs_ptr, lses_ptr, stride_op, stride_or, stride_lp, r, d, r_ok, ok)
    else:
        for p in range(0, n_parts):
            m, l, acc = _merge_part(m, l, acc, p, outs_ptr, lses_ptr, stride_op, stride_or, stride_lp, r, d, r_ok, ok)
    out, lse = merge_finish(m, l, acc)
    tl.store(out_ptr + r[:, None] * dim + d[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(lse_ptr + r, lse, mask=r_ok)


@triton.jit
def _merge_part(m, l, acc, p, outs_ptr, lses_ptr, stride_op, stride_or, stride_lp, r, d, r_ok, ok):
    """Part p's LSEs [R] and output rows [R, D] of rows r into the running merge."""
    lse_p = tl.load(lses_ptr + p * stride_lp + r, mask=r_ok, other=float("-inf"))
    o_p = tl.load(outs_ptr + p * stride_op + r[:, None] * stride_or + d[None, :], mask=ok, other=0.0)
    return merge_step(m, l, acc, lse_p, o_p)


@triton.jit
def merge_step(m, l, acc, lse_p, o_p):
    """One part into a running merge of [R] rows: m (running max, log2 units), l (sum of weights), acc [R, D]
    (weighted sum of outputs); lse_p [R] the part's natural-log LSE (-inf: it saw nothing), o_p [R, D] its output.
    The one definition of the merge's arithmetic (_merge_kernel's loop)."""
    lse_p = lse_p.to(tl.float32) * LOG2E
    m_new = tl.maximum(m, lse_p)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m - m_safe)
    w = tl.math.exp2(lse_p - m_safe)
    l = l * alpha + w
    acc = acc * alpha[:, None] + w[:, None] * o_p.to(tl.float32)
    return m_new, l, acc


@triton.jit
def merge_finish(m, l, acc):
    """The merged output [R, D] fp32 and LSE [R] (natural log) of a running merge; rows no part saw: 0, -inf."""
    empty = l == 0.0
    l_safe = tl.where(empty, 1.0, l)
    return acc / l_safe[:, None], tl.where(empty, float("-inf"), (m + tl.math.log2(l_safe)) * LN2)


@triton.jit
def _merge_all_kernel(outs_ptr, lses_ptr, out_ptr, lse_ptr, n_parts, n_rows, dim,
                      stride_op, stride_or, stride_lp,
                      P_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """The same merge with every part of BLOCK_R rows loaded at once ([P_PAD, BLOCK_R, BLOCK_D]): no chain of
    one load per part (the loop's latency: ~0.45 us a part on an H100, bench/short_attention/README.md)."""
    if PDL:
        pdl_enter(PDL)
    p = tl.arange(0, P_PAD)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    p_ok = p < n_parts
    r_ok = r < n_rows
    lse_p = tl.load(lses_ptr + p[:, None] * stride_lp + r[None, :], mask=p_ok[:, None] & r_ok[None, :],
                    other=float("-inf")).to(tl.float32) * LOG2E  # [P_PAD, BLOCK_R]
    m = tl.max(lse_p, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse_p - m_safe[None, :])  # a part that saw nothing weighs 0
    l = tl.sum(w, axis=0)
    ok = (p_ok[:, None] & r_ok[None, :])[:, :, None] & (d < dim)[None, None, :]
    o_p = tl.load(outs_ptr + p[:, None, None] * stride_op + r[None, :, None] * stride_or + d[None, None, :], mask=ok,
                  other=0.0).to(tl.float32)  # [P_PAD, BLOCK_R, BLOCK_D]
    acc = tl.sum(w[:, :, None] * o_p, axis=0)
    empty = l == 0.0
    l_safe = tl.where(empty, 1.0, l)
    o_ok = r_ok[:, None] & (d[None, :] < dim)
    tl.store(out_ptr + r[:, None] * dim + d[None, :], (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=o_ok)
    tl.store(lse_ptr + r, tl.where(empty, float("-inf"), (m + tl.math.log2(l_safe)) * LN2), mask=r_ok)


def merge_rows(outs: torch.Tensor, lses: torch.Tensor, out_dtype: torch.dtype,
               all_parts: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """outs [P, R, D] (last dim contiguous), lses [P, R] -> out [R, D] out_dtype, lse [R] fp32.
    all_parts: each program loads every part at once (_merge_all_kernel; up to MAX_ALL_PARTS parts, on more warps
    past 64 so that a thread holds ~64 values of the tile) instead of looping."""
    n_parts, n_rows, dim = outs.shape
    if outs.stride(2) != 1:
        outs = outs.contiguous()
    if lses.stride(1) != 1:
        lses = lses.contiguous()
    out = torch.empty((n_rows, dim), dtype=out_dtype, device=outs.device)
    lse = torch.empty(n_rows, dtype=torch.float32, device=outs.device)
    if n_rows and all_parts and n_parts <= MAX_ALL_PARTS:
        p_pad = triton.next_power_of_2(n_parts)
        block_d = triton.next_power_of_2(dim)
        block_r = max(1, 8192 // (p_pad * block_d))  # ~64 fp32 values of the part tile per thread (4 warps)
        warps = min(16, max(4, p_pad * block_r * block_d // 2048))
        _merge_all_kernel[(triton.cdiv(n_rows, block_r),)](
            outs, lses, out, lse, n_parts, n_rows, dim, outs.stride(0), outs.stride(1), lses.stride(0),
            P_PAD=p_pad, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps, **pdl.launch_kwargs(outs.device))
    elif n_rows:
        unroll = n_parts <= UNROLL_PARTS
        block_r = UNROLLED_BLOCK_R if unroll else BLOCK_R
        _merge_kernel[(triton.cdiv(n_rows, block_r),)](
            outs, lses, out, lse, n_parts, n_rows, dim, outs.stride(0), outs.stride(1), lses.stride(0),
            BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(dim), N_PARTS=n_parts if unroll else 0,
            **pdl.launch_kwargs(outs.device))
    return out, lse


def merge_attention(outs: torch.Tensor, lses: torch.Tensor,
                    out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """outs [P, ..., D], lses [P, ...] (fp32) -> out [..., D] (outs.dtype, or ``out_dtype``), lse [...] fp32. More
    parts than the unrolled merge takes are loaded at once (a loop over them waits on each)."""
    if outs.shape[:-1] != lses.shape or outs.dim() < 2:
        raise ValueError(f"outs {tuple(outs.shape)} and lses {tuple(lses.shape)} disagree")
    lead = outs.shape[1:-1]
    out, lse = merge_rows(outs.reshape(outs.shape[0], -1, outs.shape[-1]), lses.reshape(lses.shape[0], -1),
                          outs.dtype if out_dtype is None else out_dtype, all_parts=outs.shape[0] > UNROLL_PARTS)
    return out.reshape(*lead, outs.shape[-1]), lse.reshape(lead)
