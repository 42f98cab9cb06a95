"""What the index tests compare against."""

from __future__ import annotations

import numpy as np


def exact_attention(q, keys, values, ids, scale):
    """float64 attention of each query [B, D] over its ids [B, k] (-1 skipped): out [B, Dv], lse [B]."""
    out, lse = [], []
    for b, row in enumerate(ids):
        sel = row[row >= 0]
        logits = keys[sel].astype(np.float64) @ q[b].astype(np.float64) * scale
        top = logits.max()
        p = np.exp(logits - top)
        out.append(p @ values[sel].astype(np.float64) / p.sum())
        lse.append(top + np.log(p.sum()))
    return np.array(out), np.array(lse)


def random_heads(seed: int, hkv: int, n: int, d: int, m: int, b: int, hq: int):
    """An index set's inputs from ``np.random.default_rng(seed)``, in this order: keys, values [hkv, n, d], training
    queries [hkv, m, d] (shifted by 0.4: another distribution than the keys'), search queries [b, hq, d]; float32."""
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((hkv, n, d)).astype(np.float32)
    values = rng.standard_normal((hkv, n, d)).astype(np.float32)
    train = (rng.standard_normal((hkv, m, d)) + 0.4).astype(np.float32)
    return keys, values, train, rng.standard_normal((b, hq, d)).astype(np.float32)
