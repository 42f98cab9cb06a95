"""KV bytes per token for named model shapes, and byte budgets written with suffixes."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The KV-cache footprint of a model: layers x kv_heads x head_dim x 2 (K and V) x dtype_bytes."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        if min(self.layers, self.kv_heads, self.head_dim, self.dtype_bytes) < 1:
            raise ValueError(f"model shape {self.name!r}: every dimension must be >= 1")

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * self.dtype_bytes

    @classmethod
    def from_name(cls, text: str) -> "ModelShape":
        """A preset name, or ``LAYERS:KV_HEADS:HEAD_DIM[:DTYPE_BYTES]``."""
        key = text.strip().lower()
        if key in MODEL_SHAPES:
            return MODEL_SHAPES[key]
        parts = key.split(":")
        if 3 <= len(parts) <= 4 and all(p.isdigit() for p in parts):
            return cls(key, *(int(p) for p in parts))
        raise ValueError(f"unknown model shape {text!r}; use one of {', '.join(MODEL_SHAPES)} "
                         "or LAYERS:KV_HEADS:HEAD_DIM[:DTYPE_BYTES]")


# bf16 KV; from each model's config.json (num_hidden_layers, num_key_value_heads, head_dim).
MODEL_SHAPES = {s.name: s for s in (
    ModelShape("llama3-8b", 32, 8, 128),       # 131072 B/token
    ModelShape("llama3-70b", 80, 8, 128),      # 327680 B/token
    ModelShape("llama3.2-1b", 16, 8, 64),      # 32768 B/token
    ModelShape("qwen3-8b", 36, 8, 128),        # 147456 B/token
    ModelShape("mistral-7b", 32, 8, 128),      # 131072 B/token
)}

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_bytes(text: str) -> float:
    """``1GB`` (10^9), ``10GiB`` (2^30 each), ``512MB``, ``123``, ``4e9`` or ``unlimited`` (math.inf)."""
    key = str(text).strip().lower().replace(" ", "")
    if key in ("unlimited", "inf", "none"):
        return math.inf
    m = re.fullmatch(r"(\d+(?:\.\d+)?(?:e[+-]?\d+)?)([a-z]*)", key)
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"bad byte size {text!r}; use e.g. 1GB, 10GiB, 512MB or unlimited")
    return float(m.group(1)) * _UNITS[m.group(2)]


def format_bytes(n: float) -> str:
    if math.isinf(n):
        return "unlimited"
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:g}{unit}" if (n / size).is_integer() else f"{n / size:.2f}{unit}"
    return f"{n:g}B"
