"""The compact keys an index's searches traverse with: int8, one scale a dimension (scalar quantisation, as faiss'
SQ8 is per dimension), derived from the exact keys.

A key's dimension d is held as ``round(k_d / step_d)`` in [-127, 127], ``step_d = max_i |k_i,d| / 127`` over the
index's keys: symmetric about 0, which post-RoPE keys are (each rotated pair spans every angle over positions). A
query q scores code c as ``(q * step) . c`` = q . k up to the rounding, so the scale is folded into the query once and
a scored key costs one byte a dimension and no per-key scale (a 64-dim key in one 64-byte cache line, against four in
float32). The search traverses with these scores and rescores its beam with the exact keys before it keeps k
(``_search.rescore``): the ids and the attention returned are exact over what it keeps.

Why this form (bench/index/README.md, "Compact keys"): on the longgen model's Q/K, the exact top-100 taken from the
128 best by int8 score is recall 1.000 (per key scale: the same; bf16: the same; 4 bits: 0.926).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LEVELS = 127


@dataclass(frozen=True, slots=True)
class CompactKeys:
    """codes int8 ``[N, D]`` (C-contiguous, read-only) and step float32 ``[D]``: key i is ~ ``codes[i] * step``."""

    codes: np.ndarray
    step: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.step.nbytes


def quantize(keys: np.ndarray) -> CompactKeys:
    """``keys`` finite float32 ``[N, D]`` -> their ``CompactKeys``. A dimension that is 0 in every key (or too small
    for a float32 step) gets codes 0 and step 0; none is NaN or infinite, whatever the keys' magnitude."""
    wide = keys.astype(np.float64)
    step = np.abs(wide).max(axis=0) / LEVELS                                          # [D]
    safe = np.where(step > 0, step, 1.0)
    codes = np.clip(np.rint(wide / safe), -LEVELS, LEVELS).astype(np.int8)
    codes = np.ascontiguousarray(codes)
    step = step.astype(np.float32)
    codes[:, step == 0] = 0                      # a step that underflows float32 scores nothing, not the rounding
    for arr in (codes, step):
        arr.setflags(write=False)
    return CompactKeys(codes, step)
