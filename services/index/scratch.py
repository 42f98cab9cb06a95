"""Each thread's search scratch, allocated once and reused by its later searches.

A compiled search needs arrays as long as the index (visited marks, the keys it touched, their scores, the queue):
allocated per call they cost more than the arrays' size suggests. Large arrays are fresh pages from the kernel, so
each call faults in the pages it touches and frees them again, and a decode step's searches do so on every core at
once. A thread keeps one set per (group size, beam), grown to the largest index it has searched, and hands a search
views of the length it needs. The compiled searches leave ``visited`` all 0 on return; a search that raises may
not, so its set is dropped (``searching``) and the next search allocates a new one.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

_local = threading.local()


def _sets() -> dict:
    sets = getattr(_local, "sets", None)
    if sets is None:
        sets = _local.sets = {}
    return sets


def one(n: int, beam: int) -> tuple[np.ndarray, ...]:
    """``_search.scratch(n, beam)``'s arrays for this thread: visited uint8 [n] (all 0), touched int64 [n], ids int64
    [beam], scores float32 [beam], queue int64 [n], queue_neg float32 [n]."""
    key = ("one", beam)
    s = _sets().get(key)
    if s is None or s[0].shape[0] < n:
        s = _sets()[key] = (np.zeros(n, np.uint8), np.empty(n, np.int64), np.empty(beam, np.int64),
                            np.empty(beam, np.float32), np.empty(n, np.int64), np.empty(n, np.float32))
    visited, touched, ids, scores, queue, queue_neg = s
    return visited[:n], touched[:n], ids, scores, queue[:n], queue_neg[:n]


def group(n: int, g: int, beam: int) -> tuple[np.ndarray, ...]:
    """``_search_group.group_scratch(n, g, beam)``'s arrays for this thread: visited uint8 [n] (all 0), touched int64
    [n], seen float32 [n, g], ids int64 [g, beam], scores float32 [g, beam], sizes int64 [g], queue int64 [n],
    queue_neg float32 [n]."""
    key = ("group", g, beam)
    s = _sets().get(key)
    if s is None or s[0].shape[0] < n:
        s = _sets()[key] = (np.zeros(n, np.uint8), np.empty(n, np.int64), np.empty((n, g), np.float32),
                            np.empty((g, beam), np.int64), np.empty((g, beam), np.float32), np.zeros(g, np.int64),
                            np.empty(n, np.int64), np.empty(n, np.float32))
    visited, touched, seen, ids, scores, sizes, queue, queue_neg = s
    return visited[:n], touched[:n], seen[:n], ids, scores, sizes, queue[:n], queue_neg[:n]


@contextlib.contextmanager
def searching():
    """Around a compiled search in this thread's scratch: if it raises, the scratch (its visited marks perhaps not
    cleared) is dropped."""
    try:
        yield
    except BaseException:
        _local.sets = {}
        raise


def held_bytes() -> int:
    """The bytes of this thread's scratch sets."""
    return sum(a.nbytes for s in _sets().values() for a in s)
