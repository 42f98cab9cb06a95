"""A decoder layer's elementwise work, fused: RMSNorm (with the residual add), SiLU(gate)*up on the fused
gate|up projection, and the split of the fused q|k|v projection with per-head q/k norm and RoPE, which
may also store the new k, v rows into the paged KV cache (``KVWrite``); ``write_kv`` stores given ones.

Each function dispatches to the plain-torch twin (``backend="torch"``, any device) or the Triton kernel
(``backend="triton"``, CUDA, or the CPU under TRITON_INTERPRET=1). ``default_backend`` picks Triton
wherever it can run compiled.
"""

from __future__ import annotations

import importlib.util

import torch

from kernels.fused import reference
from kernels.fused.kv_write import KVWrite

__all__ = ["rms_norm", "add_rms_norm", "silu_mul", "qkv_heads", "write_kv", "KVWrite", "default_backend"]

BACKENDS = ("torch", "triton")


def default_backend(device: torch.device) -> str:
    """``triton`` on CUDA when Triton imports, else ``torch``."""
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "torch"


def _impl(backend: str):
    if backend == "torch":
        return reference
    if backend == "triton":
        from kernels.fused import triton

        return triton
    raise ValueError(f"unknown backend {backend!r} ({' or '.join(BACKENDS)})")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "torch") -> torch.Tensor:
    """x [..., N] -> weight * normalise(x) [..., N]: fp32 statistics, cast to x's dtype, then scaled."""
    return _impl(backend).rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 backend: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, N] -> (rms_norm(residual + x) [T, N], residual + x [T, N]), both new tensors."""
    return _impl(backend).add_rms_norm(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """gate_up [T, 2*I] (gate | up) -> silu(gate) * up [T, I]."""
    return _impl(backend).silu_mul(gate_up)


def qkv_heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, *, cos: torch.Tensor | None = None,
              sin: torch.Tensor | None = None, positions: torch.Tensor | None = None,
              inv_freq: torch.Tensor | None = None, q_norm: torch.Tensor | None = None,
              k_norm: torch.Tensor | None = None, eps: float = 1e-6, write: KVWrite | None = None,
              return_kv: bool = True, backend: str = "torch"):
    """qkv [T, (Hq + 2*Hkv) * D] -> contiguous q [T, Hq, D], k, v [T, Hkv, D]; q and k RMS-normed per
    head when q_norm/k_norm [D] are given (Qwen3), then rotated (NeoX, fp32) by cos/sin [T, 1, D/2]
    fp32 tables or by integer positions [T] with inv_freq [D/2].

    ``write``: k and v are also stored at its (block, slot) rows of one layer's paged cache, in the
    cache's dtype (what ``BlockPool.write`` would store, without its two index kernels);
    ``return_kv=False``: k and v are only stored, and come back as None."""
    return _impl(backend).qkv_heads(qkv, num_heads, num_kv_heads, cos=cos, sin=sin, positions=positions,
                                    inv_freq=inv_freq, q_norm=q_norm, k_norm=k_norm, eps=eps, write=write,
                                    return_kv=return_kv)


def write_kv(k: torch.Tensor, v: torch.Tensor, write: KVWrite, backend: str = "torch") -> None:
    """Store k, v [T, Hkv, D] at ``write``'s (block, slot) rows, cast to the cache's dtype (Triton: one
    kernel for both, where torch's indexed assignment takes one each)."""
    _impl(backend).write_kv(k, v, write)
