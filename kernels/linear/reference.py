"""y = x @ w.T (+ bias), or accumulate += x @ w.T, in plain torch (the twin of kernels/linear/triton.py).

Numerics as the kernel (and cuBLAS) round them: the product summed in fp32, the bias and the fp32 value
of ``accumulate`` added in fp32, one rounding to the output dtype. Only the order of the fp32 sum differs
from the kernel's, so results agree to fp32 rounding before the final cast."""

from __future__ import annotations

import torch


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
           accumulate: torch.Tensor | None = None, config=None) -> torch.Tensor:
    """x [M, K], w [N, K] (rows may be strided), bias [N] -> a new [M, N] in x's dtype; with accumulate
    [M, N], the sum is added into it in place and it is returned. ``config`` is the kernel's and unused."""
    y = x.float() @ w.float().t()  # fp32 inputs stay fp32 (no TF32 on the CPU; the caller's setting on CUDA)
    if bias is not None:
        y += bias.float()
    if accumulate is not None:
        y += accumulate.float()
        return accumulate.copy_(y)
    return y.to(x.dtype)


def linear_swiglu(x: torch.Tensor, w: torch.Tensor, *, config=None) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for w = [gate; up] [2I, K]: the gate|up product rounded to x's dtype,
    silu rounded, then the product rounded (what the unfused projection and kernels/fused's silu_mul do)."""
    gu = linear(x, w)
    gate, up = gu.float().chunk(2, dim=-1)
    s = (gate / (1.0 + torch.exp(-gate))).to(x.dtype)
    return (s.float() * up).to(x.dtype)
