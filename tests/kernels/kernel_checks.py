"""Tolerances and comparisons shared by the kernel tests (and bench/kernels/kernels.py's smoke run)."""

import torch

TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}  # relative L2 error
DTYPE_NAME = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64, NaN-safe (a NaN anywhere fails every tolerance)."""
    a, b = a.double(), b.double()
    if torch.isnan(a).any() or torch.isnan(b).any():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_lse_close(a: torch.Tensor, b: torch.Tensor, atol: float) -> None:
    """Log-sum-exps agree, with -inf (no key seen) in exactly the same places."""
    assert torch.equal(torch.isneginf(a), torch.isneginf(b))
    fin = torch.isfinite(b)
    assert torch.isfinite(a[fin]).all()
    if fin.any():
        assert float((a[fin].double() - b[fin].double()).abs().max()) <= atol
