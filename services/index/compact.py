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
from numba import njit

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
    for a float32 step) gets codes 0 and step 0; none is NaN or infinite, whatever the keys' magnitude. Each code is
    ``clip(rint(k / step), -127, 127)`` in float64, computed in one compiled pass (``_codes``): the numpy expression
    of it, which widens, divides and clips whole copies of the keys, took 0.202 s a 130,048-key head of 128 dims on
    one core of this repository's machine, against 0.061 (medians of five, alternated in one process)."""
    keys = np.ascontiguousarray(keys, np.float32)
    step = np.abs(keys).max(axis=0).astype(np.float64) / LEVELS                      # [D] (abs and max are exact)
    safe = np.where(step > 0, step, 1.0)
    step = step.astype(np.float32)
    codes = np.empty(keys.shape, np.int8)
    _codes(keys, safe, step == 0, codes)         # a step that underflows float32 scores nothing, not the rounding
    for arr in (codes, step):
        arr.setflags(write=False)
    return CompactKeys(codes, step)


def quantize_twin(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``quantize``'s codes and steps in plain numpy, float64 throughout: what its compiled pass must give, bit for bit
    (tests/index/test_compact.py; bench/index/quantize.py times the two)."""
    wide = keys.astype(np.float64)
    step = np.abs(wide).max(axis=0) / LEVELS
    codes = np.clip(np.rint(wide / np.where(step > 0, step, 1.0)), -LEVELS, LEVELS).astype(np.int8)
    step = step.astype(np.float32)
    codes[:, step == 0] = 0
    return codes, step


@njit(nogil=True, cache=True)
def _codes(keys, safe, zero, out):
    """``out[i, d] = clip(rint(keys[i, d] / safe[d]), -LEVELS, LEVELS)`` in float64 (0 where ``zero[d]``)."""
    for i in range(keys.shape[0]):
        for d in range(keys.shape[1]):
            if zero[d]:
                out[i, d] = 0
            else:
                out[i, d] = np.int8(min(max(np.rint(np.float64(keys[i, d]) / safe[d]), -LEVELS), LEVELS))
