"""A decoder layer's elementwise work in plain torch (the twin of ``kernels/fused/triton.py``).

Numerics are Hugging Face Llama's, op for op, so that the engine on the CPU matches ``transformers``:
  - RMSNorm normalises in fp32, casts back to the input dtype, THEN multiplies by the weight;
  - the residual sum is taken in the activations' dtype (``residual + x``) before it is normalised;
  - SwiGLU is ``silu(gate) * up``, each op rounded to the activations' dtype;
  - RoPE (NeoX rotate-half) rotates in fp32 and casts back, as ``kernels/rope`` does;
  - K/V rows written to the paged cache are cast from the activations' dtype to the cache's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fused.kv_write import KVWrite
from kernels.rope.reference import rope_cos_sin, rotate


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] normalised over its last dimension and scaled by weight [N]."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x) for x, residual [T, N]: the pre-MLP step of a layer."""
    h = residual + x
    return rms_norm(h, weight, eps), h


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2*I] (gate | up, as the fused projection writes them) -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def qkv_heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, *, cos: torch.Tensor | None = None,
              sin: torch.Tensor | None = None, positions: torch.Tensor | None = None,
              inv_freq: torch.Tensor | None = None, q_norm: torch.Tensor | None = None,
              k_norm: torch.Tensor | None = None, eps: float = 1e-6, write: KVWrite | None = None,
              return_kv: bool = True):
    """The fused projection's output qkv [T, (Hq + 2*Hkv) * D] -> q [T, Hq, D], k, v [T, Hkv, D], each
    contiguous; q and k RMS-normed per head (Qwen3, when q_norm/k_norm [D] are given) and rotated.

    The rotation is given either as fp32 tables cos, sin broadcastable to [T, 1, D/2], or as integer
    positions [T] with inv_freq [D/2] (the angles are then computed here). ``write``: k and v are also
    stored into that layer of the paged cache; ``return_kv=False``: k and v come back as None."""
    t = qkv.shape[0]
    d = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    if write is not None:
        write.check(t, num_kv_heads, d)
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q = q.reshape(t, num_heads, d)
    k = k.reshape(t, num_kv_heads, d)
    v = v.reshape(t, num_kv_heads, d).contiguous()
    if q_norm is not None:
        q = rms_norm(q, q_norm, eps)
        k = rms_norm(k, k_norm, eps)
    if cos is None:
        cos, sin = rope_cos_sin(positions, inv_freq)
        cos, sin = cos[:, None, :], sin[:, None, :]
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    if write is not None:
        _store(k, v, write)
    return (q, k, v) if return_kv else (q, None, None)


def write_kv(k: torch.Tensor, v: torch.Tensor, write: KVWrite) -> None:
    """Store k, v [T, Hkv, D] at ``write``'s (block, slot) rows, cast to the cache's dtype."""
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be [T, Hkv, D]")
    write.check(k.shape[0], k.shape[1], k.shape[2])
    _store(k, v, write)


def _store(k: torch.Tensor, v: torch.Tensor, write: KVWrite) -> None:
    write.k_cache[write.block, write.slot] = k.to(write.k_cache.dtype)
    write.v_cache[write.block, write.slot] = v.to(write.v_cache.dtype)
