"""Software prefetch for the compiled searches: ``prefetch_row(a, i)`` asks the core to start loading row ``i`` of a
C-contiguous 2-D array (each of its cache lines), ``prefetch_item(a, i)`` the line of ``a[i]`` of a 1-D one; each
returns at once. The load is a hint, never a fault, and changes no value.

Why: a graph search spends most of its time waiting for the keys it scores, read at random (on this repository's
machine 26% of a search's samples sat on the two loads of a key's first codes; bench/index/README.md, "Prefetched
keys"). A node's unvisited neighbours are known before any of them is scored, so their rows are requested
together and arrive while the first ones are scored, instead of one miss after another; and the node likely expanded
next (the queue's best) has its neighbour list requested while the scores are offered to the beams.

The hint is LLVM's ``llvm.prefetch`` (read, keep in every cache level). Its name depends on the pointers of the
LLVM that numba carries (``_name``); ``AVAILABLE`` says whether it compiled here. Where it does not, ``prefetch_row``
compiles to nothing and the searches run as they did before it.

NOTE: only the one name the LLVM version gives is tried. An ``llvm.`` name LLVM does not know is not an error it
raises: it ends the process.
"""

from __future__ import annotations

import numpy as np
from llvmlite import binding, ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

LINE = 64      # bytes a cache line


def _hint(name: str):
    """An intrinsic ``prefetch_at(a, i, j)``: a hint to load the line holding ``a[i, j]`` (``a[i]`` when ``a`` is
    1-D: ``j`` is not read), through ``name``."""

    @intrinsic
    def prefetch_at(typingctx, arr, i, j):
        def codegen(context, builder, sig, args):
            aryty = sig.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            index = [args[1]] if aryty.ndim == 1 else [args[1], args[2]]
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary, index, wraparound=False)
            byte_ptr = ir.IntType(8).as_pointer()
            i32 = ir.IntType(32)
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [byte_ptr, i32, i32, i32]), name)
            # read (0), keep in every level (3), data cache (1)
            builder.call(fn, [builder.bitcast(ptr, byte_ptr), i32(0), i32(3), i32(1)])
            return context.get_dummy_value()

        return types.void(arr, i, j), codegen

    return prefetch_at


def _compiled(hint) -> bool:
    """Whether ``hint`` compiles and runs here (on a small array, rows of int8 and float32)."""

    @njit
    def probe(a, b, c):
        hint(a, 1, 0)
        hint(b, 1, 0)
        hint(c, 1, 0)
        return a[1, 0] + b[1, 0] + c[1]

    try:
        return probe(np.ones((2, 4), np.int8), np.ones((2, 4), np.float32), np.ones(2, np.int32)) == 3.0
    except Exception:  # noqa: BLE001 - any failure to lower the intrinsic means no prefetch here, not an error
        return False


def _name(llvm_version: tuple[int, ...]) -> str:
    """The prefetch intrinsic's name in an LLVM of ``llvm_version``: llvmlite keeps typed pointers (``i8*``, mangled
    ``p0i8``) up to LLVM 15 and uses opaque ones (``ptr``, ``p0``) after."""
    return "llvm.prefetch.p0" if llvm_version[0] >= 16 else "llvm.prefetch.p0i8"


def _pick():
    hint = _hint(_name(binding.llvm_version_info))
    if _compiled(hint):
        return hint, True
    return None, False


_prefetch_at, AVAILABLE = _pick()

if AVAILABLE:
    @njit(nogil=True, cache=True, inline="always")
    def prefetch_row(a, i):
        """Hint the loads of every cache line of row ``i`` of ``a`` (2-D, C-contiguous)."""
        per_line = max(1, LINE // a.itemsize)
        for j in range(0, a.shape[1], per_line):
            _prefetch_at(a, i, j)
        _prefetch_at(a, i, a.shape[1] - 1)      # a row not aligned to a line ends in one more

    @njit(nogil=True, cache=True, inline="always")
    def prefetch_item(a, i):
        """Hint the load of the line holding ``a[i]`` (1-D)."""
        _prefetch_at(a, i, 0)
else:
    @njit(nogil=True, cache=True, inline="always")
    def prefetch_row(a, i):
        """No prefetch compiles here: nothing."""
        return None

    @njit(nogil=True, cache=True, inline="always")
    def prefetch_item(a, i):
        """No prefetch compiles here: nothing."""
        return None
