"""The compiled searches' software prefetch (services/index/_prefetch.py): it compiles on this machine's numba, reads
and writes nothing (every row of int8, float32 and unaligned arrays and every item of 1-D ones intact, the arrays'
last lines included), and
where the LLVM's prefetch name does not compile the module falls back to a prefetch that does nothing, not to an error."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from services.index import _prefetch


@njit
def _prefetch_all(a):
    for i in range(a.shape[0]):
        _prefetch.prefetch_row(a, i)
    total = 0.0
    for v in a.ravel():
        total += v
    return total


def test_a_prefetch_compiles_with_this_numba():
    assert _prefetch.AVAILABLE


@pytest.mark.parametrize("dtype", [np.int8, np.float32])
@pytest.mark.parametrize("cols", [1, 63, 64, 128, 131])
def test_prefetching_every_row_changes_nothing(dtype, cols):
    rng = np.random.default_rng(cols)
    a = (rng.standard_normal((37, cols)) * 50).astype(dtype)
    before = a.copy()
    total = _prefetch_all(a)
    np.testing.assert_array_equal(a, before)
    np.testing.assert_allclose(total, before.astype(np.float64).sum(), rtol=1e-5)


@njit
def _prefetch_items(a):
    total = 0
    for i in range(a.shape[0]):
        _prefetch.prefetch_item(a, i)
        total += a[i]
    return total


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_prefetching_every_item_changes_nothing(dtype):
    a = np.arange(-500, 777, dtype=dtype)[::1].copy()
    before = a.copy()
    assert _prefetch_items(a) == before.sum()
    np.testing.assert_array_equal(a, before)


def test_rows_not_aligned_to_a_line_are_prefetched_whole():
    # an int8 array starting 1 byte into its buffer: its 100-byte rows straddle lines unevenly
    buf = np.arange(1 + 9 * 100, dtype=np.int64).astype(np.int8)
    a = buf[1:].reshape(9, 100)
    assert a.ctypes.data % 64 != 0 and a.flags.c_contiguous
    before = a.copy()
    _prefetch_all(a)
    np.testing.assert_array_equal(a, before)


def test_no_name_compiling_means_no_prefetch_not_an_error(monkeypatch):
    monkeypatch.setattr(_prefetch, "_compiled", lambda hint: False)
    hint, available = _prefetch._pick()
    assert hint is None and available is False


def test_the_name_follows_the_llvm_pointers():
    assert _prefetch._name((14, 0, 6)) == "llvm.prefetch.p0i8"
    assert _prefetch._name((15, 0, 7)) == "llvm.prefetch.p0i8"
    assert _prefetch._name((20, 1, 8)) == "llvm.prefetch.p0"
