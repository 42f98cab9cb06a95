"""16-bit storage of offloaded keys and values: bfloat16, held in numpy as its bits (``uint16``), since neither numpy
nor numba has a bfloat16 type.

Why: a retrieval sequence's keys and values live on the host, float32 by default; at 512K tokens of an 8B-shaped
model that is 137 GB, more than a 128 GiB host holds. In bfloat16 it is half. The values lose nothing (they come from a
bfloat16 KV pool); the keys are rotated to their positions in float32, so bfloat16 rounds them once more, to within
one part in 256 of each element, about the pool's own rounding. A search still navigates the int8 codes
(``compact.py``) and rescores its beam with the exact keys widened back to float32 (``load``), one key at a time.

Rounding is to nearest, ties to even (what ``torch.Tensor.to(torch.bfloat16)`` does on the GPU, so a layer rounded
there and one rounded here hold the same bits).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

FLOAT32 = "float32"
BFLOAT16 = "bfloat16"
DTYPES = (FLOAT32, BFLOAT16)
BITS = np.dtype(np.uint16)      # a bfloat16 array's numpy dtype: its bits


def check_dtype(name: str, value) -> str:
    """``value`` if it names a storage dtype (``DTYPES``), else a ValueError naming ``name``."""
    if value not in DTYPES:
        raise ValueError(f"{name} must be one of {', '.join(DTYPES)}, got {value!r}")
    return value


def to_bf16(x: np.ndarray) -> np.ndarray:
    """Finite float32 ``x`` rounded to bfloat16, to nearest with ties to even: its bits, uint16 of ``x``'s shape."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    return rounded.astype(np.uint16)


def widen(bits: np.ndarray) -> np.ndarray:
    """bfloat16 ``bits`` (uint16) as float32, exactly: a new C-contiguous array of their shape."""
    return (np.ascontiguousarray(bits, np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def finite(bits: np.ndarray) -> bool:
    """Whether every bfloat16 of ``bits`` is finite (its exponent is not all ones: no infinity, no NaN)."""
    return not ((np.asarray(bits, np.uint16) & np.uint16(0x7F80)) == np.uint16(0x7F80)).any()


def as_float(arr: np.ndarray) -> np.ndarray:
    """``arr`` as float32: bfloat16 bits widened, a float32 array as it is."""
    return widen(arr) if arr.dtype == BITS else arr


def stored(arr: np.ndarray, dtype: str) -> np.ndarray:
    """float32 ``arr`` (or bfloat16 bits, uint16) held as ``dtype``: C-contiguous float32, or bfloat16 bits."""
    arr = np.asarray(arr)
    if dtype == BFLOAT16:
        return np.ascontiguousarray(arr) if arr.dtype == BITS else to_bf16(arr)
    return np.ascontiguousarray(as_float(arr), np.float32)


def dtype_of(arr: np.ndarray) -> str:
    """The storage dtype an array holds (bfloat16 for uint16 bits)."""
    return BFLOAT16 if arr.dtype == BITS else FLOAT32


@intrinsic
def _bits_to_float(typingctx, bits):
    """bfloat16 bits (uint16) -> float32: the bits, widened to 32 and shifted up 16, read as a float."""

    def codegen(context, builder, sig, args):
        wide = builder.zext(args[0], ir.IntType(32))
        return builder.bitcast(builder.shl(wide, ir.Constant(ir.IntType(32), 16)), ir.FloatType())

    return types.float32(types.uint16), codegen


def load(x):
    """An element of keys, codes or values as float32 in compiled code (``_search.dot``, ``attend_one``)."""
    raise NotImplementedError("load is for compiled code only")


@overload(load, inline="always")
def _load(x):
    if x == types.uint16:
        return lambda x: _bits_to_float(x)
    return lambda x: np.float32(x)
