"""Skinny GEMM for the model's projections at few rows (short passes, decode): x @ w.T (+ bias), written
to a new tensor, onto a copy of ``residual`` (out = residual + x @ w.T, the o projection onto the
residual stream: one rounding, residual not written), or added in place onto ``accumulate`` (the down
projection onto the residual, ``h.addmm_(act, down.t())``). ``norm=(g, eps)`` makes the GEMM's input
rms_norm(x) * g (the layer's input norm before q|k|v, the post-attention norm before gate|up).

``backend="torch"`` is the plain-torch twin (any device); ``backend="triton"`` the weight-streaming Triton
kernel (CUDA, or the CPU under TRITON_INTERPRET=1), which ``supported`` says is worth taking: 16-bit
activations and at most MAX_M rows (past that cuBLAS's large tiles win). ``config`` overrides the
kernel's table (``kernels.linear.config.CONFIGS``); the bench sweeps it.

The norm prologue's numerics against kernels/fused's ``rms_norm`` (whose roundings it copies: fp32 sum of
squares over the row, inv = rsqrt(sum / K + eps), y = x * inv rounded to x's dtype, then y * g rounded):
  - exact, bit for bit, wherever the fp32 sum of squares of each row comes out the same in any order (e.g.
    values with few significant bits, whose squares and partial sums fp32 holds exactly): then inv, y and
    the normalised x tile equal the norm kernel's, and the GEMM sums them as it sums a given x;
  - otherwise the kernel sums a row's squares in another order (a tree over each BLOCK_K-wide tile, the
    tiles in K order; the norm kernel: one tl.sum over the row), so inv may differ in its last fp32 bit(s)
    and an element of y whose x * inv lies at a rounding boundary of x's dtype by one unit in its last place;
    the result stays within the dtype's rounding of rms_norm + linear.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from kernels.linear import reference
from kernels.linear.config import LinearConfig, table_config

__all__ = ["linear", "linear_swiglu", "supported", "default_backend", "LinearConfig", "MAX_M"]

BACKENDS = ("torch", "triton")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_M = 128  # rows up to which the kernel is the one to take (bench/skinny_gemm/skinny_gemm.py sweeps M 1..128)


def default_backend(device: torch.device) -> str:
    """``triton`` on CUDA when Triton imports, else ``torch``."""
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "torch"


def supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the Triton path applies and should beat cuBLAS: CUDA (or the interpreter), fp16/bf16,
    1..MAX_M rows, K a multiple of 16, both operands' rows 16-byte aligned (full-width vector loads), and
    a shape and row count the measured table gives to the kernel (``config.CONFIGS``): elsewhere there is no
    evidence it beats cuBLAS, and the heuristic's split-K launches share per-device arrival counters, which
    launches on concurrent streams must not. The same answer holds with ``norm`` / ``residual`` (the table
    was measured without them; bench/skinny_gemm/skinny_gemm.py --norm-ab times them)."""
    on_device = x.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    return (on_device and x.dim() == 2 and w.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16)
            and w.dtype == x.dtype and 1 <= x.shape[0] <= MAX_M and x.shape[1] == w.shape[1]
            and x.shape[1] % 16 == 0 and x.stride(1) == 1 and w.stride(1) == 1
            and x.stride(0) % 8 == 0 and w.stride(0) % 8 == 0
            and isinstance(table_config(x.shape[0], w.shape[0], x.shape[1]), LinearConfig))


def _check(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, accumulate: torch.Tensor | None,
           norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None) -> None:
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"linear expects x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)} differ in K ({k} != {w.shape[1]})")
    if x.dtype not in DTYPES or w.dtype != x.dtype:
        raise ValueError(f"x and w must share one of fp32/fp16/bf16, got {x.dtype} and {w.dtype}")
    if x.device != w.device:
        raise ValueError(f"x on {x.device}, w on {w.device}")
    if (k > 1 and (x.stride(1) != 1 or w.stride(1) != 1)) or (m > 1 and x.stride(0) < k) or \
            (n > 1 and w.stride(0) < k):
        raise ValueError(f"x and w need unit stride along K and whole rows (strides {x.stride()} and {w.stride()})")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError(f"bias must be [{n}] {x.dtype} on {x.device}, got {tuple(bias.shape)} {bias.dtype}")
    for name, t in (("accumulate", accumulate), ("residual", residual)):
        if t is None:
            continue
        if t.shape != (m, n) or t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"{name} must be [{m}, {n}] {x.dtype} on {x.device}, got {tuple(t.shape)} {t.dtype}"
                             f" on {t.device}")
        if n > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} needs unit stride along N, got strides {t.stride()}")
    if accumulate is not None and residual is not None:
        raise ValueError("give residual (out = residual + x @ w.T, a new tensor) or accumulate (in place), not both")
    if norm is not None:
        if not isinstance(norm, tuple) or len(norm) != 2:
            raise ValueError("norm must be (g, eps): the RMSNorm weight [K] and epsilon")
        g, eps = norm
        if not isinstance(g, torch.Tensor) or g.shape != (k,) or g.dtype != x.dtype or g.device != x.device:
            raise ValueError(f"norm weight g must be [{k}] (x's K) {x.dtype} on {x.device}, got "
                             f"{tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__}"
                             f"{' ' + str(g.dtype) if isinstance(g, torch.Tensor) else ''}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0.0 <= eps < float("inf"):
            raise ValueError(f"norm eps must be a finite float >= 0, got {eps!r}")


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
           norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None,
           accumulate: torch.Tensor | None = None, backend: str = "torch",
           config: LinearConfig | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K].T (+ bias [N]) -> a new [M, N] tensor of x's dtype.

    ``norm`` = (g [K] in x's dtype, eps): x is replaced by rms_norm(x) * g, computed inside the kernel (see
    the module's note on exactness). ``residual`` [M, N] (x's dtype): the result is residual + x @ w.T
    (+ bias) in a new tensor, residual unwritten. ``accumulate`` [M, N]: the product (+ bias) is added into
    it in place instead, and it is returned.

    w may be a row slice of a larger (concatenated) weight: rows strided, K contiguous. fp32 sums, one
    rounding to the output dtype (onto the residual's or accumulate's fp32 value), as cuBLAS."""
    _check(x, w, bias, accumulate, norm, residual)
    if backend == "torch":
        return reference.linear(x, w, bias, norm=norm, residual=residual, accumulate=accumulate)
    if backend == "triton":
        from kernels.linear import triton

        norm = (norm[0].contiguous(), float(norm[1])) if norm is not None else None
        return triton.linear(x, w, bias, norm=norm, residual=residual, accumulate=accumulate, config=config)
    raise ValueError(f"unknown backend {backend!r} ({' or '.join(BACKENDS)})")


def linear_swiglu(x: torch.Tensor, w: torch.Tensor, *, norm: tuple[torch.Tensor, float] | None = None,
                  backend: str = "torch", config: LinearConfig | None = None) -> torch.Tensor:
    """The SwiGLU MLP's first half in one launch: w = [gate; up] [2I, K] (the fused gate|up weight) ->
    silu(x @ gate.T) * (x @ up.T) [M, I] in x's dtype, rounded as the projection then kernels/fused's
    silu_mul round it (gate|up product, silu, product). Where ``supported(x, w)``, the Triton kernel
    streams a tile's gate and up rows together and writes only the activation. ``norm`` = (g, eps): x is
    replaced by rms_norm(x) * g inside the kernel, as in ``linear``."""
    _check(x, w, None, None, norm)
    if w.shape[0] % 2:
        raise ValueError(f"w must hold gate then up rows (an even count), got {w.shape[0]}")
    if backend == "torch":
        return reference.linear_swiglu(x, w, norm=norm)
    if backend == "triton":
        from kernels.linear import triton

        norm = (norm[0].contiguous(), float(norm[1])) if norm is not None else None
        return triton.linear_swiglu(x, w, norm=norm, config=config)
    raise ValueError(f"unknown backend {backend!r} ({' or '.join(BACKENDS)})")
