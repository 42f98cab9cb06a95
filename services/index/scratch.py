"""Each thread's search scratch, allocated once and reused by its later searches.

A compiled search needs arrays as long as the index (visited marks, the keys it touched, their scores, the queue):
allocated per call they cost more than the arrays' size suggests. Large arrays are fresh pages from the kernel, so
each call faults in the pages it touches and frees them again, and a decode step's searches do so on every core at
once. A thread keeps one set for single queries and one for groups, each grown to the largest index, group and beam
it has searched (so at most two, whatever beams its callers ask for), and hands a search views of the length it
needs. The compiled searches leave ``visited`` all 0 on return; a search that raises may not, so the thread's sets
are dropped (``searching``) and the next search allocates new ones. (No gain measured yet: bench/index/README.md.)
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

from services.index._search import scratch
from services.index._search_group import group_scratch

_local = threading.local()


def _grown(name: str, n: int, g: int, beam: int, make) -> tuple:
    """This thread's set ``name``, made anew by ``make(n, g, beam)`` at the largest of each size it has been asked for
    when one is larger than the set's: one set a kind a thread, whatever beams and groups its searches use."""
    sets = getattr(_local, "sets", None)
    if sets is None:
        sets = _local.sets = {}
    held = sets.get(name)
    if held is None or held[0] < n or held[1] < g or held[2] < beam:
        sizes = (n, g, beam) if held is None else (max(n, held[0]), max(g, held[1]), max(beam, held[2]))
        held = sets[name] = (*sizes, make(*sizes))
    return held[3]


def one(n: int, beam: int) -> tuple[np.ndarray, ...]:
    """``_search.scratch(n, beam)``'s arrays (it makes them) for this thread: visited uint8 [n] (all 0), touched
    int64 [n], ids int64 and scores float32 (at least ``beam`` long), queue int64 [n], queue_neg float32 [n]."""
    visited, touched, ids, scores, queue, queue_neg = _grown("one", n, 1, beam, lambda n, _g, beam: scratch(n, beam))
    return visited[:n], touched[:n], ids, scores, queue[:n], queue_neg[:n]


def group(n: int, g: int, beam: int) -> tuple[np.ndarray, ...]:
    """``_search_group.group_scratch(n, g, beam)``'s arrays (it makes them) for this thread: visited uint8 [n] (all
    0), touched int64 [n], seen float32 [n, >= g], ids int64 and scores float32 [>= g, >= beam], sizes int64 [>= g],
    queue int64 [n], queue_neg float32 [n]. (The compiled searches read sizes from their ``g`` and ``beam``, not from
    the arrays.)"""
    visited, touched, seen, ids, scores, sizes, queue, queue_neg = _grown("group", n, g, beam, group_scratch)
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
    return sum(a.nbytes for held in getattr(_local, "sets", {}).values() for a in held[3])
