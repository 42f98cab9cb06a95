"""A decode layer's grouped searches in one compiled call: every piece (one row's KV head and some of its query
heads) searched, or scanned (``_scan``), and attended on numba's own threads (``prange``), with no Python between
the pieces.

Why: on the 16-core host of ``nvidia-h200`` a layer's 16 searches (130,048 keys a head) took 3.28-3.31 ms on a
thread pool, each piece's start waiting for the interpreter lock and a thread's wake-up, against 1.31-1.34 ms in one
compiled call, with equal answers (bench/index/README.md, "A layer's searches in one compiled call").

Invariants: those of ``_search_group`` for each piece; every index compact (int8 codes navigated, exact keys
rescored) and larger than the beam; the pieces' query groups of one size ``g``; piece p reads row ``row_of[p]``'s KV
head ``head_of[p]``, the place of its arrays in the nested typed lists (``lists[row][head]``); the scratch stacked a
thread (``[T, ...]`` for the call's T threads, each as ``group_scratch``'s, ``visited`` all 0, and all 0 again on
return): a thread searches its pieces one after another, in the set ``numba.get_thread_id()`` names.

NOTE: numba's default threading layer (workqueue) must not be entered by two threads at once, and its threads are
the process's: every call goes through ``attend`` below, which holds one lock for the process.

NOTE: compiling the call takes ~25 s on this repository's machine without numba's cache (~2 s loading it). No
search waits for that: ``IndexSet`` searches on its thread pool until ``ready()``; its first ``add`` (or a search
before it is ready) starts ``warming()``, which compiles the call on a few keys in a thread of its own (``warm()``
does it in the caller's).
"""

from __future__ import annotations

import threading

import numba
import numpy as np
from numba import njit, prange, typed

from services.index import half
from services.index._scan import scan_attend_group
from services.index._search_group import group_scratch, search_attend_group_into

_LOCK = threading.Lock()       # one parallel region at a time in this process (the workqueue layer's rule)
_SCRATCH: dict[tuple[int, int], list[np.ndarray]] = {}     # by (query heads a piece, beam): group_scratch's arrays
# attend_pieces compiled (or loaded from numba's cache) in this process, for exact keys and values of each storage
# dtype (``half.DTYPES``: each is a signature of its own); the lock held by the one thread compiling it
_READY = {dtype: threading.Event() for dtype in half.DTYPES}
_WARMING = {dtype: threading.Lock() for dtype in half.DTYPES}


@njit(nogil=True, parallel=True, cache=True)
def attend_pieces(navs, steps, keyss, offsets, targets, entries, values, row_of, head_of, scan_of, queries, beam, k,
                  scale, out, lse, scanned, visited, touched, seen, ids, scores, sizes, queue, queue_neg):
    """Piece p's queries ``queries[p]`` ``[g, D]`` searched in the index of row ``row_of[p]``'s KV head
    ``head_of[p]`` and its top ``k`` attended: ``out[p]`` ``[g, Dv]``, ``lse[p]`` ``[g]``, ``scanned[p]`` (keys its
    traversal read), as ``search_attend_group_into`` answers for one group; or, where ``scan_of[p]``, every key
    scanned instead, as ``_scan.scan_attend_group`` answers (``scanned[p]``: every key)."""
    for p in prange(queries.shape[0]):
        r, h, t = row_of[p], head_of[p], numba.get_thread_id()      # t in [0, threads): its scratch
        if scan_of[p]:
            scan_attend_group(navs[r][h], steps[r][h], keyss[r][h], values[r][h], queries[p:p + 1], beam, k, scale,
                              out[p:p + 1], lse[p:p + 1])
            scanned[p] = navs[r][h].shape[0]
        else:
            search_attend_group_into(navs[r][h], steps[r][h], keyss[r][h], offsets[r][h], targets[r][h],
                                     entries[r][h], values[r][h], queries[p:p + 1], beam, k, False, scale,
                                     out[p:p + 1], lse[p:p + 1], scanned[p:p + 1], visited[t], touched[t], seen[t],
                                     ids[t], scores[t], sizes[t], queue[t], queue_neg[t])


def _read_only(arr: np.ndarray) -> np.ndarray:
    """A read-only, C-contiguous view of ``arr`` (a copy only if it is not C-contiguous). Every array the call takes
    is read-only so that one compiled signature serves all (numba types a read-only array apart from a writable one,
    and a typed list holds arrays of one type)."""
    view = np.ascontiguousarray(arr).view()
    view.flags.writeable = False
    return view


class LayerArrays:
    """One (owner, layer)'s KV heads as the compiled call takes them: seven typed lists (codes, steps, exact keys,
    graph offsets, targets, entries, values), each a head; made once when the heads are, not at every call. The exact
    keys and the values are float32 or bfloat16 bits, all of one dtype (``dtype``).
    ``num_keys`` / ``max_keys``: the smallest / largest head's keys (the call needs every head larger than its beam;
    its scratch as long as the largest); ``head_keys``: each head's; ``dim`` / ``value_dim``: the keys' / values'
    head_dim."""

    __slots__ = ("lists", "num_keys", "max_keys", "alone", "head_keys", "dim", "value_dim", "dtype")

    def __init__(self, heads) -> None:
        """``heads``: the layer's ``(AttentionIndex, values)`` in KV head order."""
        cols: list[list[np.ndarray]] = [[] for _ in range(7)]
        for index, vals in heads:
            codes, step, keys, _ = index._nav(True)          # compact: int8 codes navigated, the exact keys rescored
            g = index.graph
            for col, arr in zip(cols, (codes, step, keys, g.offsets, g.targets, g.entries, vals)):
                col.append(_read_only(arr))
        self.lists = tuple(typed.List(col) for col in cols)
        self.head_keys = np.array([index.num_keys for index, _ in heads], np.int64)    # each head's keys
        self.num_keys, self.max_keys = int(self.head_keys.min()), int(self.head_keys.max())
        self.dim, self.value_dim = heads[0][0].dim, heads[0][1].shape[1]
        self.dtype = heads[0][0].key_dtype
        if any(index.key_dtype != self.dtype or half.dtype_of(vals) != self.dtype for index, vals in heads):
            raise ValueError("a layer's exact keys and values must all be of one dtype")
        # the nested lists of a call of this one row (a batch of one): made here, not at each call (~0.3 ms a call,
        # at every layer of every step)
        self.alone = tuple(typed.List([lst]) for lst in self.lists)


def _scratch(threads: int, n: int, g: int, beam: int) -> list[np.ndarray]:
    """The process's stacked scratch for pieces of ``g`` query heads and ``beam``: at least ``threads`` x
    ``group_scratch(n, g, beam)``; the lock held. Grown (never shrunk) when a call needs more threads or keys, and
    ``visited`` all 0 between calls."""
    have = _SCRATCH.get((g, beam))
    if have is not None:
        if have[0].shape[0] >= threads and have[0].shape[1] >= n:
            return [a[:threads] for a in have]
        threads, n = max(threads, have[0].shape[0]), max(n, have[0].shape[1])
    have = _SCRATCH[(g, beam)] = [np.zeros((threads,) + a.shape, a.dtype) for a in group_scratch(n, g, beam)]
    return [a[:threads] for a in have]


def nested(layers: list[LayerArrays]) -> tuple:
    """The seven nested typed lists a call of ``layers``' rows takes (``lists[row][head]``); ~0.1 ms a row to make,
    so a caller that calls again with the same rows keeps them (``IndexSet``)."""
    if len(layers) == 1:
        return layers[0].alone
    return tuple(typed.List([lay.lists[c] for lay in layers]) for c in range(7))


def attend(layers: list[LayerArrays], row_of: np.ndarray, head_of: np.ndarray, scan_of: np.ndarray,
           queries: np.ndarray, beam: int, k: int, scale: float, threads: int,
           cols: tuple | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pieces ``queries`` float32 ``[P, g, D]``, piece p reading ``layers[row_of[p]]``'s KV head ``head_of[p]``
    (scanning every key where ``scan_of[p]``), on at most ``threads`` of numba's threads -> out float32
    ``[P, g, Dv]``, lse float32 ``[P, g]``, scanned int64 ``[P]``. ``cols``: ``nested(layers)`` when the caller
    kept it. The caller checks the invariants (every index larger than ``beam``, ``beam >= k``, finite queries)."""
    p, g, _ = queries.shape
    dv = layers[0].value_dim
    out = np.empty((p, g, dv), np.float32)
    lse = np.empty((p, g), np.float32)
    scanned = np.empty(p, np.int64)
    n = max(lay.max_keys for lay in layers)
    cols = nested(layers) if cols is None else cols
    t = max(1, min(threads, p, numba.config.NUMBA_NUM_THREADS))
    with _LOCK:
        numba.set_num_threads(t)
        attend_pieces(*cols, row_of, head_of, scan_of, queries, beam, k, float(scale), out, lse, scanned,
                      *_scratch(t, n, g, beam))
    return out, lse, scanned


def ready(dtype: str = half.FLOAT32) -> bool:
    """Whether the compiled call for exact keys and values of ``dtype`` is ready in this process (``warm`` has run)."""
    return _READY[dtype].is_set()


def warm(dtype: str = half.FLOAT32) -> None:
    """Compile the call (or load it from numba's cache) for the argument types ``attend`` passes with exact keys and
    values of ``dtype``, on two pieces of a four-key index, in this thread; ``ready(dtype)`` after. Idempotent."""
    if _READY[dtype].is_set():
        return
    with _WARMING[dtype]:
        if _READY[dtype].is_set():
            return
        d = 4
        keys = half.stored(np.eye(4, d, dtype=np.float32), dtype)
        ring = np.array([1, 2, 3, 0], np.int32)                   # key i's one neighbour: i + 1
        head = (np.eye(4, d, dtype=np.int8), np.ones(d, np.float32), keys, np.arange(5, dtype=np.int64), ring,
                np.zeros(1, np.int64), keys.copy())
        cols = [typed.List([typed.List([_read_only(head[c])])]) for c in range(7)]
        scratch = [np.zeros((numba.get_num_threads(),) + a.shape, a.dtype) for a in group_scratch(4, 1, 2)]
        out, lse, scanned = np.empty((2, 1, d), np.float32), np.empty((2, 1), np.float32), np.empty(2, np.int64)
        with _LOCK:
            attend_pieces(*cols, np.zeros(2, np.int64), np.zeros(2, np.int64), np.array([False, True]),
                          np.ones((2, 1, d), np.float32), 2, 1, 1.0, out, lse, scanned, *scratch)
        _READY[dtype].set()


def warming(dtype: str = half.FLOAT32) -> None:
    """Start ``warm(dtype)`` in a daemon thread of its own unless it has run or is running; returns at once."""
    if _READY[dtype].is_set() or _WARMING[dtype].locked():
        return
    threading.Thread(target=warm, args=(dtype,), name="index-compile", daemon=True).start()
