"""Keep freed heap memory in a store process instead of handing it back to the kernel at once.

Every layer a store reads or receives is a fresh buffer of a few MiB (a RocksDB value, the
Python ``bytes`` made from it, a gRPC message). With glibc's defaults such a buffer is either
``mmap``-ed and unmapped on free, or sits at the top of a heap that is trimmed soon after; either
way the next buffer faults its pages in again and the kernel zeroes them. On this repository's
2-vCPU host that page-fault work was half or more of a RocksDB read's CPU (bench/kvstore/README.md has
the figures). With these settings freed layers are reused by the next ones: the process keeps at
most ``TRIM_THRESHOLD`` of free memory at the top of its heap, small beside a store's DRAM budget.

Process-wide, so it is applied by the store's own entry points (``create_server``), never by the
client library inside someone else's process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1      # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
TRIM_THRESHOLD = 256 << 20
MMAP_THRESHOLD = 32 << 20  # glibc's own upper bound for its dynamic threshold; larger blocks are mmap-ed
ARENA_MAX = 1              # one heap for all threads: a per-thread arena (at most 64 MiB a heap) made
                           # and dropped heaps as RocksDB reads in executor threads came and went

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the thresholds once per process; False where the C library is not glibc."""
    global _applied
    if _applied is None:
        _applied = False
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):
            log.info("no glibc mallopt: freed layer buffers go back to the kernel (slower reads)")
            return False
        mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        _applied = all(mallopt(param, value) == 1 for param, value in (
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_ARENA_MAX, ARENA_MAX)))
    return _applied
