"""What both skinny-GEMM kernels share: the pointer kernel (kernels/linear/triton.py) and the TMA one
(kernels/linear/tma.py). The K step's dots, the SwiGLU activation, the fp32 epilogue, the L2 prefetch of weight
rows, and the host-side constexprs of the dot's precision and of a programmatic dependent launch.

Imports run one way: triton.py -> tma.py -> common.py (triton.py imports this module too); nothing here imports
either kernel.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import pdl as pdl_switch

# the interpreter's bf16 dot is wrong: there (only) bf16 tiles are upcast to fp32 before the dot. Read when the
# kernels are defined, as Triton decides then whether they are interpreted.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def dot_consts(dtype: torch.dtype) -> dict:
    """PRECISION and UPCAST for tiles of ``dtype``: under the interpreter bf16 tiles are upcast to fp32 before the
    dot (exact products of the same values, "ieee" sums); fp32 tiles sum as "ieee", 16-bit ones on tensor cores."""
    upcast = INTERPRET and dtype == torch.bfloat16
    return dict(PRECISION="ieee" if dtype == torch.float32 or upcast else "tf32", UPCAST=upcast)


def pdl_consts(pdl: int) -> dict:
    """The constexprs and launch option of a one-split launch with ``pdl`` (-1: an ordinary launch; N >= 0: a
    programmatic dependent launch asking L2 for N weight steps before its wait). Compiled launches only: L2
    prefetches and griddepcontrol are PTX, which the interpreter does not run."""
    if pdl < 0 or os.environ.get("TRITON_INTERPRET") == "1":
        return dict(PDL=False, PREFETCH_STEPS=0)
    return dict(PDL=pdl_switch.mode(), PREFETCH_STEPS=pdl, launch_pdl=True)


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
def swiglu_act(acc, acc_u, dt: tl.constexpr):
    """silu(gate) * up from the fp32 gate and up tiles, rounded as the unfused kernels round it: each projection
    to dt, silu to dt, then the product to dt (kernels/fused's silu_mul)."""
    g = acc.to(dt).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dt)
    return (s.to(tl.float32) * acc_u.to(dt).to(tl.float32)).to(dt)


@triton.jit
def epilogue(acc, offs_m, offs_n, n_ok, ok, b_ptr, c_ptr, out_ptr, stride_cm, stride_om,
             HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr):
    """acc (fp32) + bias + accumulate's fp32 value, rounded once to the output's dtype."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    if ACCUMULATE:
        acc += tl.load(c_ptr + rows * stride_cm + offs_n[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


_PREFETCH_L2 = tl.constexpr("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $2, 0;\n\t@p prefetch.global.L2 [$1];\n\t"
                             "mov.u32 $0, 0;\n\t}")


@triton.jit
def prefetch_rows(w_ptr, rn, k_lo, k_hi, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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
