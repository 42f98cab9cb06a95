"""Skinny GEMM for short passes and decode steps: y[M, N] = x[M, K] @ w[N, K].T with M <= ~128.

At such M the work is reading the weight once (a Llama-3-8B layer's 436 MB at 64 rows is ~0.9 FLOP per
byte): the kernel streams w through a pipelined K loop (``num_stages`` tiles in flight per program)
and fills the GPU with N tiles x K splits rather than M tiles. Twin: reference.py (fp32 sums, one
rounding).

  - grid (M tiles, N tiles, K splits); M tiles of one weight tile are neighbours, so their repeated
    reads of it hit L2;
  - split K: each program writes an fp32 partial [split, M, N]; the partials are summed in split order
    (deterministic, whoever finishes first) by the tile's last program to arrive (a per-tile counter,
    reset by that program: one launch) or by a second kernel (``reduce="kernel"``);
  - epilogue in fp32: + bias, + the fp32 value of ``accumulate`` (the down projection onto the
    residual, in place), one rounding to the output dtype;
  - a config with ``tma`` runs kernels/linear/tma.py's kernel instead (one split, the same sums).

CUDA-graph capturable: no host sync, the grid and the workspace are functions of the shapes alone (the
workspace is allocated per call, the counters once per device and kept zeroed by the kernel itself).
Only long-standing ``tl`` operations are used (Triton 3.6 and later).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
import triton
import triton.language as tl

from kernels import pdl as pdl_switch
from kernels.linear import tma
from kernels.linear.common import dot_consts, dots, epilogue, pdl_consts, prefetch_rows, swiglu_act
from kernels.linear.config import LinearConfig
from kernels.linear.plan import (  # noqa: F401  (re-exported: the bench and the tests name them here)
    _COUNTERS, MAX_TILES_COUNTED, _counters, heuristic_config, pick_config, sm_count, split_plan, swiglu_config)
from kernels.pdl import enter as pdl_enter

# One-split launches are programmatic dependent launches while kernels/pdl.py says a launch on their device takes
# part (KernelOptions.pdl), each program first asking L2 for this many steps of its weight rows while the kernel
# before it finishes (the best of bench/pdl_stack/pdl_stack.py's projection chain at 64 rows: 5.30 -> 5.13 ms);
# a caller's own ``pdl=`` (-1 off, N >= 0 steps) overrides it per launch.
PDL_PREFETCH_STEPS = 2


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, c_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, k_split, n_split, stride_ws,
                   stride_xm, stride_wn, stride_cm, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr,
                   HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, EVEN_K: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr, SWIGLU: tl.constexpr = False,
                   PDL: tl.constexpr = False, PREFETCH_STEPS: tl.constexpr = 0):
    """Program (M tile, N tile, K split). MODE 0: one split, the epilogue writes out. MODE 1: writes its
    fp32 partial to ws[split]; a second kernel reduces. MODE 2: writes its partial, and the tile's last
    program to arrive sums ws[0..n_split) in order and writes out.
    SWIGLU (MODE 0 only): w holds 2N rows, gate then up; the program also streams the up rows n + N and
    writes silu(gate) * up, rounded as the unfused pair of kernels rounds it (gate|up, silu, product).
    PDL (launched as a programmatic dependent launch): the program may start while the kernel before it in the
    stream is still running; it first asks L2 for its first PREFETCH_STEPS steps of weight rows (the weights
    are never written), then waits for that kernel (griddepcontrol.wait) before it reads or writes anything
    else, and lets the next kernel launch."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    # weight rows past N wrap onto valid ones (their columns are never stored): no mask on the stream
    rn = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    k0 = pid_k * k_split
    if PREFETCH_STEPS > 0:  # the weights are never written: asked for before the wait
        prefetch_rows(w_ptr, rn, k0, tl.minimum(K, k0 + PREFETCH_STEPS * BLOCK_K), stride_wn, BLOCK_N, BLOCK_K)
        if SWIGLU:
            prefetch_rows(w_ptr, rn + N, k0, tl.minimum(K, k0 + PREFETCH_STEPS * BLOCK_K), stride_wn, BLOCK_N,
                          BLOCK_K)
    if PDL:
        pdl_enter(PDL)
    k_end = tl.minimum(K, k0 + k_split)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + (k0 + offs_k)[None, :]
    w_ptrs = w_ptr + rn[:, None] * stride_wn + (k0 + offs_k)[None, :]
    u_ptrs = w_ptr + (rn + N)[:, None] * stride_wn + (k0 + offs_k)[None, :]  # SWIGLU: the up rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k0, k_end, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            b = tl.load(w_ptrs)
            if SWIGLU:
                bu = tl.load(u_ptrs)
        else:
            k_ok = (k + offs_k) < k_end
            a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            if SWIGLU:
                bu = tl.load(u_ptrs, mask=k_ok[None, :], other=0.0)
        if not SWIGLU:
            bu = b  # (unused)
        acc, acc_u = dots(a, b, bu, acc, acc_u, PRECISION, UPCAST, SWIGLU)
        if SWIGLU:
            u_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    ok = m_ok[:, None] & n_ok[None, :]
    mn = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    if SWIGLU:
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
                 swiglu_act(acc, acc_u, out_ptr.dtype.element_ty), mask=ok)
    elif MODE == 0:
        epilogue(acc, offs_m, offs_n, n_ok, ok, b_ptr, c_ptr, out_ptr, stride_cm, stride_om, HAS_BIAS, ACCUMULATE)
    else:
        tl.store(ws_ptr + pid_k.to(tl.int64) * stride_ws + mn, acc, mask=ok)
        if MODE == 2:
            tl.debug_barrier()  # every thread's partial is written before the release below
            tile = pid_m * tl.num_programs(1) + pid_n
            arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
            if arrived == n_split - 1:  # the last of the tile: sum the splits in order, then reset the counter
                tl.debug_barrier()
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                part_ptrs = ws_ptr + mn
                for _ in range(0, n_split):  # .cg: read past L1, which may hold a previous call's partials
                    total += tl.load(part_ptrs, mask=ok, other=0.0, cache_modifier=".cg")
                    part_ptrs += stride_ws
                epilogue(total, offs_m, offs_n, n_ok, ok, b_ptr, c_ptr, out_ptr, stride_cm, stride_om,
                         HAS_BIAS, ACCUMULATE)
                tl.atomic_xchg(cnt_ptr + tile, 0)


@triton.jit
def _reduce_kernel(ws_ptr, b_ptr, c_ptr, out_ptr, M, N, n_split, stride_ws, stride_cm, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                   ACCUMULATE: tl.constexpr):
    """Program (M tile, N tile): sums the split partials ws[0..n_split) in order, then the epilogue."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    ok = (offs_m < M)[:, None] & n_ok[None, :]
    mn = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    part_ptrs = ws_ptr + mn
    for _ in range(0, n_split):
        total += tl.load(part_ptrs, mask=ok, other=0.0)
        part_ptrs += stride_ws
    epilogue(total, offs_m, offs_n, n_ok, ok, b_ptr, c_ptr, out_ptr, stride_cm, stride_om, HAS_BIAS, ACCUMULATE)


def _plan(m: int, n: int, k: int, dtype: torch.dtype, cfg: LinearConfig, bias: bool, accumulate: bool,
          swiglu: bool = False, pdl: int = -1):
    """(grid, mode, splits, the kernel's integer arguments up to the strides, its constexprs and options)."""
    k_split, n_split = split_plan(k, cfg.block_k, cfg.split_k)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), n_split)
    mode = 0 if n_split == 1 else (2 if cfg.reduce == "arrive" else 1)
    consts = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, MODE=mode, HAS_BIAS=bias,
                  ACCUMULATE=accumulate, EVEN_K=k % k_split == 0, **dot_consts(dtype), SWIGLU=swiglu,
                  **pdl_consts(pdl if mode == 0 else -1), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return grid, mode, n_split, (m, n, k, k_split, n_split, m * n), consts


_TMA_REFUSED: set[str] = set()  # reasons already warned about


def _tma_or_pointer(x: torch.Tensor, w: torch.Tensor, cfg: LinearConfig) -> LinearConfig:
    """cfg if its TMA launch can run here (kernels/linear/tma.py's ``ineligible``), else cfg without TMA (the
    pointer kernel), warning once per reason."""
    why = tma.ineligible(x, w, cfg)
    if why is None:
        return cfg
    if why not in _TMA_REFUSED:
        _TMA_REFUSED.add(why)
        warnings.warn(f"kernels.linear: {cfg.short()} runs without TMA: {why}", RuntimeWarning, stacklevel=3)
    return dataclasses.replace(cfg, tma="off")


def pdl_steps(device: torch.device) -> int:
    """The PDL prefetch depth a launch on ``device`` gets when its caller names none: PDL_PREFETCH_STEPS while
    kernels/pdl.py says a launch there takes part, else -1 (an ordinary launch)."""
    return PDL_PREFETCH_STEPS if pdl_switch.active(device) else -1


def warmup(m: int, n: int, k: int, dtype: torch.dtype, cfg: LinearConfig, *, bias: bool = False,
           accumulate: bool = False, stride_w: int | None = None, swiglu: bool = False, pdl: int = -1) -> None:
    """Compile (into Triton's cache) the kernels a launch of this shape and config would run, without
    tensors or a launch: the bench compiles its sweep on many processes at once with this. Strides are
    those of contiguous x, out and accumulate, and ``stride_w`` (default K) for w; with ``swiglu``, n is
    the activation's width (w holds 2n rows); ``pdl`` as ``linear``'s. TMA configs: kernels/linear/tma.py's
    ``warmup``."""
    if cfg.tma != "off":
        return tma.warmup(m, n, k, dtype, cfg, bias=bias, accumulate=accumulate, swiglu=swiglu, pdl=pdl,
                          stride_w=stride_w)
    grid, mode, n_split, ints, consts = _plan(m, n, k, dtype, cfg, bias, accumulate, swiglu=swiglu, pdl=pdl)
    ws, cnt = (torch.float32 if mode else dtype), (torch.int32 if mode == 2 else dtype)  # as linear() passes
    _linear_kernel.warmup(dtype, dtype, dtype, dtype, dtype, ws, cnt, *ints, k,
                          k if stride_w is None else stride_w, n, n, grid=grid, **consts)
    if mode == 1:
        _reduce_kernel.warmup(torch.float32, dtype, dtype, dtype, m, n, n_split, m * n, n, n, grid=grid[:2],
                              BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_BIAS=bias, ACCUMULATE=accumulate,
                              num_warps=4)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
           accumulate: torch.Tensor | None = None, config: LinearConfig | None = None,
           pdl: int | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K].T (+ bias [N]) as a new [M, N] tensor of x's dtype, or added into ``accumulate``
    [M, N] in place (returned). Inputs are validated by the caller (kernels.linear)."""
    m, k = x.shape
    n = w.shape[0]
    out = accumulate if accumulate is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:  # an empty sum: the twin adds the bias (or nothing)
        from kernels.linear import reference

        return reference.linear(x, w, bias, accumulate=accumulate)
    cfg = config or pick_config(m, n, k, sm_count(x.device))
    pdl = pdl_steps(x.device) if pdl is None else pdl
    if cfg.tma != "off":
        cfg = _tma_or_pointer(x, w, cfg)
    if cfg.tma != "off":
        return tma.launch(x, w, out, cfg, bias=bias, accumulate=accumulate, swiglu=False, pdl=pdl)
    grid, mode, n_split, ints, consts = _plan(m, n, k, x.dtype, cfg, bias is not None, accumulate is not None,
                                              pdl=pdl)
    ws = torch.empty((n_split, m, n), dtype=torch.float32, device=x.device) if mode else out
    cnt = _counters(x.device, grid[0] * grid[1]) if mode == 2 else out
    b = bias if bias is not None else out  # unread without HAS_BIAS
    _linear_kernel[grid](x, w, b, out, out, ws, cnt, *ints, x.stride(0), w.stride(0), out.stride(0), out.stride(0),
                         **consts)
    if mode == 1:
        _reduce_kernel[grid[:2]](ws, b, out, out, m, n, n_split, m * n, out.stride(0), out.stride(0),
                                 BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_BIAS=bias is not None,
                                 ACCUMULATE=accumulate is not None, num_warps=4)
    return out


def linear_swiglu(x: torch.Tensor, w: torch.Tensor, *, config: LinearConfig | None = None,
                  pdl: int | None = None) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) [M, I] for w = [gate; up] [2I, K], one launch (validated by the caller)."""
    m, k = x.shape
    inter = w.shape[0] // 2
    out = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    if m == 0 or inter == 0:
        return out
    if k == 0:
        from kernels.linear import reference

        return reference.linear_swiglu(x, w)
    cfg = config or swiglu_config(m, inter, k, sm_count(x.device))
    if cfg.split_k != 1:
        raise ValueError("the fused gate|up kernel runs one split")
    pdl = pdl_steps(x.device) if pdl is None else pdl
    if cfg.tma != "off":
        cfg = _tma_or_pointer(x, w, cfg)
    if cfg.tma != "off":
        return tma.launch(x, w, out, cfg, bias=None, accumulate=None, swiglu=True, pdl=pdl)
    grid, _, _, ints, consts = _plan(m, inter, k, x.dtype, cfg, False, False, swiglu=True, pdl=pdl)
    _linear_kernel[grid](x, w, out, out, out, out, out, *ints, x.stride(0), w.stride(0), out.stride(0),
                         out.stride(0), **consts)
    return out
