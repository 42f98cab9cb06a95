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
