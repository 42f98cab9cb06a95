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
    residual, in place) or of ``residual`` (the o projection onto it, written to a new tensor), one
    rounding to the output dtype;
  - ``norm``: an RMSNorm prologue. Each program asks L2 for its first NORM_PREFETCH_STEPS weight steps,
    reads its rows of x over all of K once (from L2) for each row's 1/rms, then normalises every x tile
    of the K loop as it is loaded, with rms_norm's roundings (kernels.linear's docstring says what is
    exact). Its extra cost is that pre-pass: every N tile re-reads its rows of x from L2 once more.

CUDA-graph capturable: no host sync, the grid and the workspace are functions of the shapes alone (the
workspace is allocated per call, the counters once per device and kept zeroed by the kernel itself).
Only long-standing ``tl`` operations are used (Triton 3.6 and later).
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import torch
import triton
import triton.language as tl

from kernels import pdl as pdl_switch
from kernels.pdl import enter as pdl_enter
from kernels.linear.config import LinearConfig
from kernels.linear.plan import (  # noqa: F401  (re-exported: the bench and the tests name them here)
    _COUNTERS, MAX_TILES_COUNTED, _counters, heuristic_config, pick_config, sm_count, split_plan, swiglu_config)

# One-split launches are programmatic dependent launches while kernels/pdl.py says a launch on their device takes
# part (KernelOptions.pdl), each program first asking L2 for this many steps of its weight rows while the kernel
# before it finishes (the best of bench/pdl_stack/pdl_stack.py's projection chain at 64 rows: 5.30 -> 5.13 ms);
# a caller's own ``pdl=`` (-1 off, N >= 0 steps) overrides it per launch.
PDL_PREFETCH_STEPS = 2
# norm prologue (``norm=``): weight steps each program asks L2 for before its pre-pass over x reads the rows'
# sums of squares (HBM streams meanwhile; not yet measured: bench/skinny_gemm/skinny_gemm.py --norm-ab sweeps it), and
# the pre-pass loop's pipeline depth (tiles of x in flight from L2)
NORM_PREFETCH_STEPS = 8
NORM_PASS_STAGES = 4
# the interpreter's bf16 dot is wrong: there (only) bf16 tiles are upcast to fp32 before the dot
_UPCAST_BF16 = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, c_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, k_split, n_split, stride_ws,
                   stride_xm, stride_wn, stride_cm, stride_om, g_ptr, eps,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr,
                   HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, EVEN_K: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr, SWIGLU: tl.constexpr = False,
                   PDL: tl.constexpr = False, PREFETCH_STEPS: tl.constexpr = 0, NORM: tl.constexpr = False,
                   NORM_STAGES: tl.constexpr = 3):
    """Program (M tile, N tile, K split). MODE 0: one split, the epilogue writes out. MODE 1: writes its
    fp32 partial to ws[split]; a second kernel reduces. MODE 2: writes its partial, and the tile's last
    program to arrive sums ws[0..n_split) in order and writes out.
    SWIGLU (MODE 0 only): w holds 2N rows, gate then up; the program also streams the up rows n + N and
    writes silu(gate) * up, rounded as the unfused pair of kernels rounds it (gate|up, silu, product).
    PDL (launched as a programmatic dependent launch): the program may start while the kernel before it in the
    stream is still running; it first asks L2 for its first PREFETCH_STEPS steps of weight rows (the weights
    are never written), then waits for that kernel (griddepcontrol.wait) before it reads or writes anything
    else, and lets the next kernel launch.
    NORM: the GEMM's input is rms_norm(x) * g (kernels/fused's rounding): the program asks L2 for its first
    PREFETCH_STEPS weight steps (HBM stays busy meanwhile), reads its rows of x once over all of K for each
    row's 1/rms (x is small and in L2), then normalises each x tile of the K loop as it is loaded."""
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
    if PREFETCH_STEPS > 0:  # the weights are never written: asked for before the wait (PDL) or the norm's pre-pass
        _prefetch_rows(w_ptr, rn, k0, tl.minimum(K, k0 + PREFETCH_STEPS * BLOCK_K), stride_wn, BLOCK_N, BLOCK_K)
        if SWIGLU:
            _prefetch_rows(w_ptr, rn + N, k0, tl.minimum(K, k0 + PREFETCH_STEPS * BLOCK_K), stride_wn, BLOCK_N,
                           BLOCK_K)
    if PDL:
        pdl_enter(PDL)
    k_end = tl.minimum(K, k0 + k_split)
    if NORM:
        inv = _row_inv_rms(x_ptr, offs_m, m_ok, K, stride_xm, eps, BLOCK_M, BLOCK_K, EVEN_K, NORM_STAGES)
        g_ptrs = g_ptr + k0 + offs_k
        gk = tl.load(g_ptrs, mask=(k0 + offs_k) < k_end, other=0.0)
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
        if NORM:
            a, gk, g_ptrs = norm_step(a, inv, gk, g_ptrs, k + BLOCK_K + offs_k < k_end, BLOCK_K)
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
        _epilogue(acc, offs_m, offs_n, n_ok, ok, b_ptr, c_ptr, out_ptr, stride_cm, stride_om, HAS_BIAS, ACCUMULATE)
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
                _epilogue(total, offs_m, offs_n, n_ok, ok, b_ptr, c_ptr, out_ptr, stride_cm, stride_om,
                          HAS_BIAS, ACCUMULATE)
                tl.atomic_xchg(cnt_ptr + tile, 0)


@triton.jit
def dots(a, b, bu, acc, acc_u, PRECISION: tl.constexpr, UPCAST: tl.constexpr, SWIGLU: tl.constexpr):
    """One K step: acc += a @ b.T, and with SWIGLU acc_u += a @ bu.T (the up rows). UPCAST: the interpreter's bf16
    dot multiplies garbage, so there the tiles are upcast first (exact fp32 products of the same values)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
        if SWIGLU:
            bu = bu.to(tl.float32)
    acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    if SWIGLU:
        acc_u = tl.dot(a, tl.trans(bu), acc_u, input_precision=PRECISION)
    return acc, acc_u


@triton.jit
def norm_step(a, inv, gk, g_ptrs, next_ok, BLOCK_K: tl.constexpr):
    """The norm prologue on one K step's x tile: (normalise(a) with this step's g, the next step's g, its
    pointers). The next step's g is asked for first (one element a thread: too narrow for the async
    pipeline); next_ok masks its columns past K."""
    g_ptrs += BLOCK_K
    g_next = tl.load(g_ptrs, mask=next_ok, other=0.0)
    return normalise(a, inv, gk), g_next, g_ptrs


@triton.jit
def normalise(a, inv, gk):
    """An x tile [BM, BK] through rms_norm's roundings (kernels/fused): bf16(x * inv), then bf16(y * g); inv [BM]
    fp32, gk [BK] the norm weight's columns."""
    y = (a.to(tl.float32) * inv[:, None]).to(a.dtype)
    return (y.to(tl.float32) * gk.to(tl.float32)[None, :]).to(a.dtype)


@triton.jit
def swiglu_act(acc, acc_u, dt: tl.constexpr):
    """silu(gate) * up from the fp32 gate and up tiles, rounded as the unfused kernels round it: each projection
    to dt, silu to dt, then the product to dt (kernels/fused's silu_mul)."""
    g = acc.to(dt).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dt)
    return (s.to(tl.float32) * acc_u.to(dt).to(tl.float32)).to(dt)


@triton.jit
def _row_inv_rms(x_ptr, offs_m, m_ok, K, stride_xm, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, STAGES: tl.constexpr):
    """rsqrt(mean(x^2) + eps) [BLOCK_M] of rows offs_m of x [M, K] in fp32 (rows past M: rsqrt(eps), unused).
    The sum of squares runs over BLOCK_K-wide column tiles in K order (a tree within a tile, then the
    tiles in sequence): another order than kernels/fused's one tl.sum over the row (see kernels.linear)."""
    rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    offs_k = tl.arange(0, BLOCK_K)
    ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):  # pipelined: many tiles of x in flight from L2
        if EVEN_K:
            xv = tl.load(rows + (k + offs_k)[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
        else:
            xv = tl.load(rows + (k + offs_k)[None, :], mask=m_ok[:, None] & ((k + offs_k) < K)[None, :],
                         other=0.0).to(tl.float32)
        ss += tl.sum(xv * xv, axis=1)
    return tl.rsqrt(ss / K + eps)


_PREFETCH_L2 = tl.constexpr("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $2, 0;\n\t@p prefetch.global.L2 [$1];\n\t"
                             "mov.u32 $0, 0;\n\t}")


@triton.jit
def _prefetch_rows(w_ptr, rn, k_lo, k_hi, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """prefetch.global.L2 of weight rows rn [BLOCK_N], columns [k_lo, k_hi): one 128-byte line a lane."""
    LINE: tl.constexpr = 128 // w_ptr.dtype.element_ty.primitive_bitwidth * 8  # elements a line
    PER_ROW: tl.constexpr = BLOCK_K // LINE if BLOCK_K >= LINE else 1
    r = tl.arange(0, BLOCK_N * PER_ROW)
    row = tl.reshape(tl.broadcast_to(rn[:, None], (BLOCK_N, PER_ROW)), (BLOCK_N * PER_ROW,))
    col = (r % PER_ROW) * LINE
    for k in range(k_lo, k_hi, BLOCK_K):
        ok = (k + col) < k_hi
        tl.inline_asm_elementwise(_PREFETCH_L2, "=r,l,r", [w_ptr + row * stride_wn + k + col, ok.to(tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _epilogue(acc, offs_m, offs_n, n_ok, ok, b_ptr, c_ptr, out_ptr, stride_cm, stride_om,
              HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr):
    """acc (fp32) + bias + accumulate's fp32 value, rounded once to the output's dtype."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    if ACCUMULATE:
        acc += tl.load(c_ptr + rows * stride_cm + offs_n[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


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
    _epilogue(total, offs_m, offs_n, n_ok, ok, b_ptr, c_ptr, out_ptr, stride_cm, stride_om, HAS_BIAS, ACCUMULATE)


def _plan(m: int, n: int, k: int, dtype: torch.dtype, cfg: LinearConfig, bias: bool, accumulate: bool,
          swiglu: bool = False, pdl: int = -1, norm: bool = False, norm_prefetch: int = 0):
    """(grid, mode, splits, the kernel's integer arguments up to the strides, its constexprs and options)."""
    k_split, n_split = split_plan(k, cfg.block_k, cfg.split_k)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), n_split)
    mode = 0 if n_split == 1 else (2 if cfg.reduce == "arrive" else 1)
    upcast = _UPCAST_BF16 and dtype == torch.bfloat16
    compiled = os.environ.get("TRITON_INTERPRET") != "1"  # L2 prefetches and PDL are PTX: not interpreted
    consts = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, MODE=mode, HAS_BIAS=bias,
                  ACCUMULATE=accumulate, EVEN_K=k % k_split == 0,
                  PRECISION="ieee" if dtype == torch.float32 or upcast else "tf32", UPCAST=upcast,
                  SWIGLU=swiglu, PDL=False, NORM=norm, NORM_STAGES=NORM_PASS_STAGES,
                  PREFETCH_STEPS=max(0, norm_prefetch) if norm and compiled else 0,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if pdl >= 0 and mode == 0 and compiled:
        consts.update(PDL=pdl_switch.mode(), PREFETCH_STEPS=max(pdl, consts["PREFETCH_STEPS"]), launch_pdl=True)
    return grid, mode, n_split, (m, n, k, k_split, n_split, m * n), consts


_TMA_REFUSED: set[str] = set()  # reasons already warned about


def _tma_or_pointer(x: torch.Tensor, w: torch.Tensor, cfg: LinearConfig) -> LinearConfig:
    """cfg if its TMA launch can run here (kernels/linear/tma.py's ``ineligible``), else cfg without TMA (the
    pointer kernel), warning once per reason."""
    from kernels.linear import tma

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
           accumulate: bool = False, stride_w: int | None = None, norm: bool = False, swiglu: bool = False,
           pdl: int = -1) -> None:
    """Compile (into Triton's cache) the kernels a launch of this shape and config would run, without
    tensors or a launch: the bench compiles its sweep on many processes at once with this. Strides are
    those of contiguous x, out and accumulate (or residual), and ``stride_w`` (default K) for w; with
    ``swiglu``, n is the activation's width (w holds 2n rows); ``pdl`` as ``linear``'s. TMA configs:
    kernels/linear/tma.py's ``warmup``."""
    if cfg.tma != "off":
        from kernels.linear import tma

        return tma.warmup(m, n, k, dtype, cfg, bias=bias, accumulate=accumulate, swiglu=swiglu, norm=norm, pdl=pdl,
                          stride_w=stride_w)
    grid, mode, n_split, ints, consts = _plan(m, n, k, dtype, cfg, bias, accumulate, swiglu=swiglu, norm=norm,
                                              pdl=pdl)
    ws, cnt = (torch.float32 if mode else dtype), (torch.int32 if mode == 2 else dtype)  # as linear() passes
    _linear_kernel.warmup(dtype, dtype, dtype, dtype, dtype, ws, cnt, *ints, k,
                          k if stride_w is None else stride_w, n, n, dtype, 1e-5, grid=grid, **consts)
    if mode == 1:
        _reduce_kernel.warmup(torch.float32, dtype, dtype, dtype, m, n, n_split, m * n, n, n, grid=grid[:2],
                              BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_BIAS=bias, ACCUMULATE=accumulate,
                              num_warps=4)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
           norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None,
           accumulate: torch.Tensor | None = None, config: LinearConfig | None = None,
           pdl: int | None = None, norm_prefetch: int | None = None) -> torch.Tensor:
    """(rms_norm(x) * g if ``norm`` = (g, eps), else x) [M, K] @ w[N, K].T (+ bias [N]) (+ ``residual``
    [M, N]) as a new [M, N] tensor of x's dtype, or added into ``accumulate`` [M, N] in place (returned).
    Inputs are validated by the caller (kernels.linear)."""
    m, k = x.shape
    n = w.shape[0]
    out = accumulate if accumulate is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:  # an empty sum: the twin adds the bias and the residual (or nothing)
        from kernels.linear import reference

        return reference.linear(x, w, bias, norm=norm, residual=residual, accumulate=accumulate)
    cfg = config or pick_config(m, n, k, sm_count(x.device))
    if norm is not None and config is None and cfg.split_k > 1:  # every split re-reads whole rows for 1/rms
        cfg = dataclasses.replace(cfg, split_k=1)
    if cfg.tma != "off":
        cfg = _tma_or_pointer(x, w, cfg)
    if cfg.tma != "off":
        from kernels.linear import tma

        return tma.launch(x, w, out, cfg, bias=bias, c=accumulate if accumulate is not None else residual,
                          swiglu=False, norm=norm, pdl=pdl_steps(x.device) if pdl is None else pdl,
                          norm_prefetch=NORM_PREFETCH_STEPS if norm_prefetch is None else norm_prefetch)
    c = accumulate if accumulate is not None else residual if residual is not None else out
    adds = accumulate is not None or residual is not None  # c's fp32 value added before the one rounding
    grid, mode, n_split, ints, consts = _plan(
        m, n, k, x.dtype, cfg, bias is not None, adds, pdl=pdl_steps(x.device) if pdl is None else pdl,
        norm=norm is not None, norm_prefetch=NORM_PREFETCH_STEPS if norm_prefetch is None else norm_prefetch)
    ws = torch.empty((n_split, m, n), dtype=torch.float32, device=x.device) if mode else out
    cnt = _counters(x.device, grid[0] * grid[1]) if mode == 2 else out
    b = bias if bias is not None else out  # unread without HAS_BIAS (c, g likewise without theirs)
    g, eps = (norm[0], float(norm[1])) if norm is not None else (out, 0.0)
    _linear_kernel[grid](x, w, b, c, out, ws, cnt, *ints, x.stride(0), w.stride(0), c.stride(0), out.stride(0),
                         g, eps, **consts)
    if mode == 1:
        _reduce_kernel[grid[:2]](ws, b, c, out, m, n, n_split, m * n, c.stride(0), out.stride(0),
                                 BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_BIAS=bias is not None,
                                 ACCUMULATE=adds, num_warps=4)
    return out


def linear_swiglu(x: torch.Tensor, w: torch.Tensor, *, norm: tuple[torch.Tensor, float] | None = None,
                  config: LinearConfig | None = None, pdl: int | None = None,
                  norm_prefetch: int | None = None) -> torch.Tensor:
    """silu(x' @ gate.T) * (x' @ up.T) [M, I] for w = [gate; up] [2I, K], one launch, x' = rms_norm(x) * g
    with ``norm`` = (g, eps), else x (validated by the caller)."""
    m, k = x.shape
    inter = w.shape[0] // 2
    out = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    if m == 0 or inter == 0:
        return out
    if k == 0:
        from kernels.linear import reference

        return reference.linear_swiglu(x, w, norm=norm)
    cfg = config or swiglu_config(m, inter, k, sm_count(x.device), norm=norm is not None)
    if cfg.split_k != 1:
        raise ValueError("the fused gate|up kernel runs one split")
    if cfg.tma != "off":
        cfg = _tma_or_pointer(x, w, cfg)
    if cfg.tma != "off":
        from kernels.linear import tma

        return tma.launch(x, w, out, cfg, bias=None, c=None, swiglu=True, norm=norm,
                          pdl=pdl_steps(x.device) if pdl is None else pdl,
                          norm_prefetch=NORM_PREFETCH_STEPS if norm_prefetch is None else norm_prefetch)
    grid, _, _, ints, consts = _plan(
        m, inter, k, x.dtype, cfg, False, False, swiglu=True, pdl=pdl_steps(x.device) if pdl is None else pdl,
        norm=norm is not None, norm_prefetch=NORM_PREFETCH_STEPS if norm_prefetch is None else norm_prefetch)
    g, eps = (norm[0], float(norm[1])) if norm is not None else (out, 0.0)
    _linear_kernel[grid](x, w, out, out, out, out, out, *ints, x.stride(0), w.stride(0), out.stride(0),
                         out.stride(0), g, eps, **consts)
    return out
