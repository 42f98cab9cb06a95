"""Compiled loops of the attention index: best-first beam search by inner product on a CSR graph.

Invariants (every function here): ``keys`` float32 ``[N, D]`` C-contiguous; the graph is CSR, ``offsets``
int64 ``[N + 1]`` and ``targets`` int32 ``[E]`` (key i's out-neighbours are
``targets[offsets[i]:offsets[i + 1]]``, none of them i, no duplicates); ``entry`` a key id.

NOTE: every function is ``nogil`` and keeps its state in arrays it allocates per call (the visited marks,
the beam), never in a module global: the index service searches the heads of a layer from several
threads at once.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(nogil=True, cache=True, fastmath=True, inline="always")
def dot(a: np.ndarray, b: np.ndarray) -> float:
    acc = np.float32(0.0)
    for i in range(a.shape[0]):
        acc += a[i] * b[i]
    return acc


@njit(nogil=True, cache=True, inline="always")
def _insert(ids, scores, expanded, size, cap, node, score) -> int:
    """Insert ``node`` into the beam (``ids``/``scores`` sorted by descending score, ``size`` used of ``cap``);
    returns its position, or ``cap`` when it does not make the beam. The last entry falls off a full beam."""
    if size == cap and score <= scores[size - 1]:
        return cap
    pos = size if size < cap else cap - 1
    while pos > 0 and scores[pos - 1] < score:
        pos -= 1
    end = size if size < cap else cap - 1
    for j in range(end, pos, -1):
        ids[j], scores[j], expanded[j] = ids[j - 1], scores[j - 1], expanded[j - 1]
    ids[pos], scores[pos], expanded[pos] = node, score, False
    return pos


@njit(nogil=True, cache=True, fastmath=True)
def beam_search_one(keys, offsets, targets, entry, query, beam, visited, touched, ids, scores, expanded):
    """One query's best-first search; returns ``(size, scanned, n_touched)``.

    The beam (``ids``/``scores``, length ``beam``) ends sorted by descending inner product with ``query``;
    ``scanned`` counts the inner products computed (each key at most once: ``visited`` uint8 ``[N]``, reset
    by the caller from ``touched[:n_touched]``)."""
    size = 0
    visited[entry] = 1
    touched[0] = entry
    n_touched = 1
    ids[0], scores[0], expanded[0] = entry, dot(keys[entry], query), False
    size = 1
    scanned = 1
    cursor = 0
    while cursor < size:
        node = ids[cursor]
        expanded[cursor] = True
        best = size                   # the lowest position a new key lands at in this expansion
        for e in range(offsets[node], offsets[node + 1]):
            nb = targets[e]
            if visited[nb]:
                continue
            visited[nb] = 1
            touched[n_touched] = nb
            n_touched += 1
            score = dot(keys[nb], query)
            scanned += 1
            pos = _insert(ids, scores, expanded, size, beam, nb, score)
            if pos < beam:
                if size < beam:
                    size += 1
                if pos < best:
                    best = pos
        # continue from the best unexpanded key: one this expansion placed above the cursor, else the next
        cursor = best if best <= cursor else cursor + 1
        while cursor < size and expanded[cursor]:
            cursor += 1
    return size, scanned, n_touched


@njit(nogil=True, cache=True)
def search_batch(keys, offsets, targets, entry, queries, beam, k, out_ids, out_scores, out_scanned):
    """Search every row of ``queries`` ``[B, D]``: ``out_ids`` int64 ``[B, k]`` (-1 past the beam's keys),
    ``out_scores`` float32 ``[B, k]``, ``out_scanned`` int64 ``[B]``. ``beam >= k``."""
    n = keys.shape[0]
    visited = np.zeros(n, np.uint8)
    touched = np.empty(n, np.int64)
    ids = np.empty(beam, np.int64)
    scores = np.empty(beam, np.float32)
    expanded = np.empty(beam, np.bool_)
    for b in range(queries.shape[0]):
        size, scanned, n_touched = beam_search_one(keys, offsets, targets, entry, queries[b], beam, visited,
                                                   touched, ids, scores, expanded)
        for j in range(k):
            if j < size:
                out_ids[b, j], out_scores[b, j] = ids[j], scores[j]
            else:
                out_ids[b, j], out_scores[b, j] = -1, -np.inf
        out_scanned[b] = scanned
        for j in range(n_touched):
            visited[touched[j]] = 0
