"""Rotary position embedding, plain torch (the twin of ``kernels/rope/triton.py``).

NeoX / rotate-half layout, as in Hugging Face Llama: a head vector x = [x1, x2] (two halves of
D/2) at position p becomes [x1*cos - x2*sin, x2*cos + x1*sin] with angle p * inv_freq.
Angles and the rotation are computed in fp32 and the result is cast back to x's dtype.

Rotation is a group action: R_a(R_b x) == R_{a+b} x for any frequency set, scaled or not, which is
what lets a key cached at a chunk-local position be moved to any global position inside attention.
"""

from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies, fp32 [head_dim // 2], with optional Llama-3 scaling.

    ``scaling`` is the Hugging Face ``rope_scaling`` dict; ``None`` or type ``default`` means none.
    Any other type is refused by name (the engine refuses it at load, this guards direct callers).
    """
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, llama3)")
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin fp32 [..., D/2] for integer positions [...] (negative positions rotate backwards)."""
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(positions.device, torch.float32)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by its positions [T] (int). Returns x's dtype."""
    if x.dim() != 3 or positions.shape != x.shape[:1]:
        raise ValueError(f"apply_rope expects x [T, H, D] and positions [T], got {tuple(x.shape)} and {tuple(positions.shape)}")
    cos, sin = rope_cos_sin(positions, inv_freq)  # [T, D/2]
    return rotate(x, cos.unsqueeze(1), sin.unsqueeze(1))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotation of x [..., D] by fp32 cos/sin broadcastable to [..., D/2]."""
    half = x.shape[-1] // 2
    xf = x.to(torch.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def gather_rotate(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor, offsets: torch.Tensor,
                  inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every slot of the blocks block_ids [E] of paged caches [N, BS, H, D], gathered flat: k, v [E*BS, H, D]
    in the caches' dtype, block e's keys rotated forward by offsets[e] (fp32 math, as ``rotate``)."""
    ids = block_ids.long()
    cos, sin = rope_cos_sin(offsets.long(), inv_freq)  # [E, D/2]
    k = rotate(k_cache[ids], cos[:, None, None, :], sin[:, None, None, :])  # [E, BS, H, D]
    return k.reshape(-1, *k_cache.shape[2:]), v_cache[ids].reshape(-1, *v_cache.shape[2:])
