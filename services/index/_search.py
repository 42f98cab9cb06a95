"""Compiled loops of the attention index: best-first beam search by inner product on a CSR graph.

Invariants (every function here): ``keys`` float32 or bfloat16 bits (``half.py``) ``[N, D]`` C-contiguous (the exact
keys), ``values`` likewise; ``nav`` the keys a search traverses with, ``[N, D]`` C-contiguous, float32 (the exact keys
themselves) or int8 codes (``compact.py``), and ``step`` float32 ``[D]`` the factor a query takes to score them (ones
for float32); the graph is CSR, ``offsets`` int64 ``[N + 1]`` and ``targets`` int32 ``[E]`` (key i's out-neighbours are
``targets[offsets[i]:offsets[i + 1]]``, none of them i, no duplicates); ``entries`` int64 ``[>= 1]``: the key ids
a search starts from (one for a built index, one a part for a composed one: ``graph.AttentionIndex.compose``).

NOTE: every function is ``nogil`` and keeps its state (the visited marks, the beam) in arrays it allocates per
call or, in the ``_into`` forms, in the caller's scratch (services/index/scratch.py, one set a thread), never in a
module global: the index service searches the heads of a layer from several threads at once.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from services.index._prefetch import prefetch_row
from services.index.half import load


@njit(nogil=True, cache=True, fastmath=True, inline="always")
def dot(a: np.ndarray, b: np.ndarray) -> float:
    """``a . b`` in float32; ``a`` float32, bfloat16 bits (``half.py``) or int8 (a compact key's codes, ``b`` a query
    scaled by the step)."""
    acc = np.float32(0.0)
    for i in range(a.shape[0]):
        acc += load(a[i]) * b[i]
    return acc


@njit(nogil=True, cache=True, fastmath=True)
def rescore(keys, query, ids, scores, size):
    """The beam ``ids[:size]`` scored again with the exact ``keys`` and sorted by descending exact score: what a
    search on compact keys keeps its top k from (the traversal's scores are the codes' own, off by their rounding)."""
    for j in range(size):
        prefetch_row(keys, ids[j])
    for j in range(size):
        scores[j] = dot(keys[ids[j]], query)
    order = np.argsort(-scores[:size])
    ids[:size], scores[:size] = ids[:size][order], scores[:size][order]


@njit(nogil=True, cache=True, inline="always")
def _sift_down(ids, scores, size, i):
    """Restore the min-heap (by score) below position ``i``."""
    while True:
        child = 2 * i + 1
        if child >= size:
            return
        if child + 1 < size and scores[child + 1] < scores[child]:
            child += 1
        if scores[child] >= scores[i]:
            return
        ids[i], ids[child] = ids[child], ids[i]
        scores[i], scores[child] = scores[child], scores[i]
        i = child


@njit(nogil=True, cache=True, inline="always")
def _sift_up(ids, scores, i):
    """Restore the min-heap (by score) above position ``i``."""
    while i > 0:
        parent = (i - 1) // 2
        if scores[parent] <= scores[i]:
            return
        ids[i], ids[parent] = ids[parent], ids[i]
        scores[i], scores[parent] = scores[parent], scores[i]
        i = parent


@njit(nogil=True, cache=True, inline="always")
def _offer(nb, score, beam, ids, scores, size, queue, queue_neg, queued):
    """Key ``nb`` scored ``score`` into the beam, if it has room or beats its worst, and then into the queue
    too; returns the new ``(size, queued)``."""
    if size < beam:
        ids[size], scores[size] = nb, score
        _sift_up(ids, scores, size)
        size += 1
    elif score > scores[0]:
        ids[0], scores[0] = nb, score
        _sift_down(ids, scores, size, 0)
    else:
        return size, queued
    queue[queued], queue_neg[queued] = nb, -score
    _sift_up(queue, queue_neg, queued)
    return size, queued + 1


@njit(nogil=True, cache=True, fastmath=True, inline="always")
def _visit(nb, keys, query, beam, visited, touched, n_touched, ids, scores, size, queue, queue_neg, queued):
    """Key ``nb`` scored and offered (``_offer``) unless visited already; returns ``(size, queued, n_touched)``."""
    if visited[nb]:
        return size, queued, n_touched
    visited[nb] = 1
    touched[n_touched] = nb
    size, queued = _offer(nb, dot(keys[nb], query), beam, ids, scores, size, queue, queue_neg, queued)
    return size, queued, n_touched + 1


@njit(nogil=True, cache=True, inline="always")
def mark_unvisited(node, offsets, targets, visited, touched, n_touched):
    """Key ``node``'s out-neighbours not visited yet, marked and appended to ``touched`` from ``n_touched`` on;
    returns the new ``n_touched``."""
    for e in range(offsets[node], offsets[node + 1]):
        nb = targets[e]
        if not visited[nb]:
            visited[nb] = 1
            touched[n_touched] = nb
            n_touched += 1
    return n_touched


@njit(nogil=True, cache=True)
def scratch(n, beam):
    """Per-call state of ``beam_search_one`` for an index of ``n`` keys: visited marks (all 0), the keys
    marked, the beam (``beam`` entries) and the queue of keys to expand (at most ``n``)."""
    return (np.zeros(n, np.uint8), np.empty(n, np.int64), np.empty(beam, np.int64), np.empty(beam, np.float32),
            np.empty(n, np.int64), np.empty(n, np.float32))


@njit(nogil=True, cache=True, fastmath=True)
def beam_search_one(keys, offsets, targets, entries, query, beam, visited, touched, ids, scores, queue, queue_neg):
    """One query's best-first search from every key of ``entries``; returns ``(size, scanned, n_touched)``.

    The beam holds the best ``beam`` keys scored so far (a min-heap by inner product: its root is the one to
    drop); the queue holds the keys still to expand (a min-heap by negated score: its root is the best). A key
    is expanded while the beam has room or it beats the beam's worst, the same keys a beam kept as a sorted
    list expands, at O(log beam) a scored key instead of O(beam). On return ``ids``/``scores[:size]`` are
    sorted by descending score. ``scanned`` counts the inner products computed (each key at most once:
    ``visited``, which the caller resets from ``touched[:n_touched]``); the entries count."""
    size, queued, n_touched = 0, 0, 0
    fresh = np.empty(64, np.float32)          # one expansion's scores (grown for a node of more neighbours)
    for i in range(entries.shape[0]):
        size, queued, n_touched = _visit(entries[i], keys, query, beam, visited, touched, n_touched, ids, scores, size,
                                         queue, queue_neg, queued)
    while queued > 0:
        node, node_score = queue[0], -queue_neg[0]
        queued -= 1
        queue[0], queue_neg[0] = queue[queued], queue_neg[queued]
        _sift_down(queue, queue_neg, queued, 0)
        if size == beam and node_score < scores[0]:
            break                     # every key left in the queue is worse than the whole beam
        # the node's unvisited neighbours first, then their scores in one tight loop (independent key reads the
        # core overlaps), then the offers: a key's read no longer waits behind the heap work of the one before
        first = n_touched
        if offsets[node + 1] - offsets[node] > fresh.shape[0]:
            fresh = np.empty(offsets[node + 1] - offsets[node], np.float32)
        n_touched = mark_unvisited(node, offsets, targets, visited, touched, n_touched)
        for j in range(first, n_touched):     # every row requested before the first is scored (_prefetch.py)
            prefetch_row(keys, touched[j])
        for j in range(first, n_touched):
            fresh[j - first] = dot(keys[touched[j]], query)
        for j in range(first, n_touched):
            size, queued = _offer(touched[j], fresh[j - first], beam, ids, scores, size, queue, queue_neg, queued)
    order = np.argsort(-scores[:size])
    ids[:size], scores[:size] = ids[:size][order], scores[:size][order]
    return size, n_touched, n_touched      # every key touched was scored once


@njit(nogil=True, cache=True)
def attend_one(ids, scores, m, values, scale, acc, out):
    """Attention over ``ids[:m]`` of scores ``scores[:m]`` (sorted by descending score, m >= 1): the softmax of the
    scaled scores weighting ``values`` rows into ``out`` float32 ``[Dv]`` (``acc`` float64 ``[Dv]`` scratch);
    returns the log-sum-exp of the scaled scores. NOTE: no fastmath here or in its callers: so compiled, the first
    key's weight came out 0 at scores of 1e30 (a division by zero), and k exps are no part of a search's cost."""
    best = np.float64(scores[0])                 # sorted by descending score: the largest
    total = 0.0
    acc[:] = 0.0
    for j in range(m):
        prefetch_row(values, ids[j])
    for j in range(m):
        # NOTE: the difference first, then the scale: s * scale - top may be contracted to one fused multiply-add
        # (fastmath), whose unrounded product differs from top's rounded one by up to 1e13 at huge scores
        p = np.exp((np.float64(scores[j]) - best) * scale)
        total += p
        row = values[ids[j]]
        for t in range(values.shape[1]):
            acc[t] += p * load(row[t])
    for t in range(values.shape[1]):
        out[t] = acc[t] / total
    return best * scale + np.log(total)


@njit(nogil=True, cache=True)
def search_batch(nav, step, keys, offsets, targets, entries, queries, beam, k, exact_nav, out_ids, out_scores,
                 out_scanned):
    """Search every row of ``queries`` ``[B, D]`` on ``nav`` (the query scaled by ``step``), then rescore the beam
    with ``keys`` unless ``exact_nav`` (``nav`` is ``keys``): ``out_ids`` int64 ``[B, k]`` (-1 past the beam's keys),
    ``out_scores`` float32 ``[B, k]`` (exact), ``out_scanned`` int64 ``[B]`` (keys the traversal scored; a rescore
    reads the beam's exact keys besides). ``beam >= k``."""
    visited, touched, ids, scores, queue, queue_neg = scratch(nav.shape[0], beam)
    search_batch_into(nav, step, keys, offsets, targets, entries, queries, beam, k, exact_nav, out_ids, out_scores,
                      out_scanned, visited, touched, ids, scores, queue, queue_neg)


@njit(nogil=True, cache=True)
def search_batch_into(nav, step, keys, offsets, targets, entries, queries, beam, k, exact_nav, out_ids, out_scores,
                      out_scanned, visited, touched, ids, scores, queue, queue_neg):
    """``search_batch`` in the caller's ``scratch`` (its arrays at least ``nav.shape[0]`` long, ``beam`` as the
    call's; ``visited`` all 0, and all 0 again on return), so that a thread searching again and again allocates it
    once (services/index/scratch.py)."""
    q = np.empty(queries.shape[1], np.float32)
    for b in range(queries.shape[0]):
        q[:] = queries[b] * step
        size, scanned, n_touched = beam_search_one(nav, offsets, targets, entries, q, beam, visited, touched, ids,
                                                   scores, queue, queue_neg)
        if not exact_nav:
            rescore(keys, queries[b], ids, scores, size)
        for j in range(k):
            if j < size:
                out_ids[b, j], out_scores[b, j] = ids[j], scores[j]
            else:
                out_ids[b, j], out_scores[b, j] = -1, -np.inf
        out_scanned[b] = scanned
        for j in range(n_touched):
            visited[touched[j]] = 0


@njit(nogil=True, cache=True)
def search_attend(nav, step, keys, offsets, targets, entries, values, queries, beam, k, exact_nav, scale, out, lse,
                  out_scanned):
    """Search every row of ``queries`` ``[B, D]`` for its top ``k`` keys (as ``search_batch``) and attend them:
    ``out`` float32 ``[B, Dv]`` (the softmax of the scaled exact scores over those keys, weighting ``values``
    ``[N, Dv]``), ``lse`` float32 ``[B]`` (natural log of the summed exp of the scaled scores), ``out_scanned`` int64
    ``[B]``. ``beam >= k``."""
    visited, touched, ids, scores, queue, queue_neg = scratch(nav.shape[0], beam)
    search_attend_into(nav, step, keys, offsets, targets, entries, values, queries, beam, k, exact_nav, scale, out,
                       lse, out_scanned, visited, touched, ids, scores, queue, queue_neg)


@njit(nogil=True, cache=True)
def search_attend_into(nav, step, keys, offsets, targets, entries, values, queries, beam, k, exact_nav, scale, out,
                       lse, out_scanned, visited, touched, ids, scores, queue, queue_neg):
    """``search_attend`` in the caller's ``scratch``, as ``search_batch_into``."""
    q = np.empty(queries.shape[1], np.float32)
    dv = values.shape[1]
    acc = np.empty(dv, np.float64)
    for b in range(queries.shape[0]):
        q[:] = queries[b] * step
        size, scanned, n_touched = beam_search_one(nav, offsets, targets, entries, q, beam, visited, touched, ids,
                                                   scores, queue, queue_neg)
        if not exact_nav:
            rescore(keys, queries[b], ids, scores, size)
        lse[b] = attend_one(ids, scores, min(k, size), values, scale, acc, out[b])
        out_scanned[b] = scanned
        for j in range(n_touched):
            visited[touched[j]] = 0
