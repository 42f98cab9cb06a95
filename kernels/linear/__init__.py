"""Skinny GEMM for the model's projections at few rows (short passes, decode): x @ w.T (+ bias), written
to a new tensor or added in place onto ``accumulate`` (the down projection onto the residual,
``h.addmm_(act, down.t())``); ``linear_swiglu`` fuses gate|up with the SwiGLU activation.

``backend="torch"`` is the plain-torch twin (any device); ``backend="triton"`` the weight-streaming Triton
kernel (CUDA, or the CPU under TRITON_INTERPRET=1), which ``supported`` says is worth taking: 16-bit
activations and at most MAX_M rows (past that cuBLAS's large tiles win). ``config`` overrides the
kernel's table (``kernels.linear.config.CONFIGS``); the bench sweeps it.

Modules: config.py (LinearConfig and the measured table, no Triton), plan.py (the config a launch gets, split
plan, arrival counters), common.py (the jit pieces both kernels share), tma.py (the TMA weight stream),
triton.py (the pointer kernel and the launchers, which hand TMA configs to tma.py), reference.py (the twin).
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
    launches on concurrent streams must not."""
    on_device = x.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    return (on_device and x.dim() == 2 and w.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16)
            and w.dtype == x.dtype and 1 <= x.shape[0] <= MAX_M and x.shape[1] == w.shape[1]
            and x.shape[1] % 16 == 0 and x.stride(1) == 1 and w.stride(1) == 1
            and x.stride(0) % 8 == 0 and w.stride(0) % 8 == 0
            and isinstance(table_config(x.shape[0], w.shape[0], x.shape[1]), LinearConfig))


def _check(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, accumulate: torch.Tensor | None) -> None:
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
    if accumulate is not None:
        c = accumulate
        if c.shape != (m, n) or c.dtype != x.dtype or c.device != x.device:
            raise ValueError(f"accumulate must be [{m}, {n}] {x.dtype} on {x.device}, got {tuple(c.shape)} {c.dtype}"
                             f" on {c.device}")
        if n > 1 and c.stride(1) != 1:
            raise ValueError(f"accumulate needs unit stride along N, got strides {c.stride()}")


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
           accumulate: torch.Tensor | None = None, backend: str = "torch",
           config: LinearConfig | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K].T (+ bias [N]) -> a new [M, N] tensor of x's dtype; with ``accumulate`` [M, N]
    the product (+ bias) is added into it in place instead, and it is returned.

    w may be a row slice of a larger (concatenated) weight: rows strided, K contiguous. fp32 sums, one
    rounding to the output dtype (onto accumulate's fp32 value), as cuBLAS."""
    _check(x, w, bias, accumulate)
    if backend == "torch":
        return reference.linear(x, w, bias, accumulate=accumulate)
    if backend == "triton":
        from kernels.linear import triton

        return triton.linear(x, w, bias, accumulate=accumulate, config=config)
    raise ValueError(f"unknown backend {backend!r} ({' or '.join(BACKENDS)})")


def linear_swiglu(x: torch.Tensor, w: torch.Tensor, *, backend: str = "torch",
                  config: LinearConfig | None = None) -> torch.Tensor:
    """The SwiGLU MLP's first half in one launch: w = [gate; up] [2I, K] (the fused gate|up weight) ->
    silu(x @ gate.T) * (x @ up.T) [M, I] in x's dtype, rounded as the projection then kernels/fused's
    silu_mul round it (gate|up product, silu, product). Where ``supported(x, w)``, the Triton kernel
    streams a tile's gate and up rows together and writes only the activation."""
    _check(x, w, None, None)
    if w.shape[0] % 2:
        raise ValueError(f"w must hold gate then up rows (an even count), got {w.shape[0]}")
    if backend == "torch":
        return reference.linear_swiglu(x, w)
    if backend == "triton":
        from kernels.linear import triton

        return triton.linear_swiglu(x, w, config=config)
    raise ValueError(f"unknown backend {backend!r} ({' or '.join(BACKENDS)})")
