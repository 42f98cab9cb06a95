"""Compiled loops of a GQA group's query heads searched together: one best-first traversal for all G heads that read
one KV head, each key read once and scored against every head, each head keeping its own beam.

Why: a decode step's search is bound by reading keys at random (services/index/README.md); G heads searched apart
read the keys their searches share G times. On the longgen model's Q/K one traversal reaches each head's recall@100
reading fewer keys a query head than G searches (bench/index/README.md, "GQA groups searched together").

Invariants: those of ``_search`` (``nav`` and ``step``, the exact ``keys``, the CSR graph, ``entries``); ``queries``
float32 ``[g, D]`` a group (``[B, g, D]`` a batch of groups). Every function is ``nogil``, its state in arrays allocated
per call or, in the ``_into`` forms, in the caller's scratch (services/index/scratch.py, _layer.py).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from services.index._prefetch import prefetch_item, prefetch_row
from services.index._search import _sift_down, _sift_up, attend_one, dot, mark_unvisited, rescore


@njit(nogil=True, cache=True)
def group_scratch(n, g, beam):
    """Per-call state of ``beam_search_group`` for an index of ``n`` keys and ``g`` query heads: visited marks (all 0),
    the keys marked, each marked key's ``g`` scores (by its place in ``touched``), each head's beam and its size, and
    the queue (places in ``touched``, at most ``n``)."""
    return (np.zeros(n, np.uint8), np.empty(n, np.int64), np.empty((n, g), np.float32), np.empty((g, beam), np.int64),
            np.empty((g, beam), np.float32), np.zeros(g, np.int64), np.empty(n, np.int64), np.empty(n, np.float32))


@njit(nogil=True, cache=True)
def _weights(queries):
    """Per head, the factor its scores take in the combined score that orders the queue: the first head's query norm
    over the head's own, so each head steers as if its query had the same norm (1.0 exactly for the first head: one
    head searches as ``beam_search_one`` does; 0 for a zero query, which scores every key 0)."""
    g = queries.shape[0]
    w = np.ones(g, np.float32)
    norms = np.empty(g, np.float32)
    for h in range(g):
        norms[h] = np.sqrt(dot(queries[h], queries[h]))
    ref = norms[0] if norms[0] > 0 else np.float32(1.0)
    for h in range(g):
        w[h] = ref / norms[h] if norms[h] > 0 else np.float32(0.0)
    return w


@njit(nogil=True, cache=True, inline="always")
def _sift_down_row(ids, scores, h, size, i):
    """``_sift_down`` of head ``h``'s beam, row ``h`` of ``ids``/``scores`` ``[g, beam]``."""
    while True:
        child = 2 * i + 1
        if child >= size:
            return
        if child + 1 < size and scores[h, child + 1] < scores[h, child]:
            child += 1
        if scores[h, child] >= scores[h, i]:
            return
        ids[h, i], ids[h, child] = ids[h, child], ids[h, i]
        scores[h, i], scores[h, child] = scores[h, child], scores[h, i]
        i = child


@njit(nogil=True, cache=True, inline="always")
def _sift_up_row(ids, scores, h, i):
    """``_sift_up`` of head ``h``'s beam."""
    while i > 0:
        parent = (i - 1) // 2
        if scores[h, parent] <= scores[h, i]:
            return
        ids[h, i], ids[h, parent] = ids[h, parent], ids[h, i]
        scores[h, i], scores[h, parent] = scores[h, parent], scores[h, i]
        i = parent


@njit(nogil=True, cache=True, fastmath=True, inline="always")
def _score_group(first, n_touched, keys, queries, touched, seen, weights, beam, ids, scores, sizes, queue,
                 queue_neg, queued):
    """Score ``touched[first:n_touched]`` against every head (one read of each key), offer each score to its head's
    beam, and queue a key that entered some head's beam by its combined score; returns the new ``queued``."""
    g = queries.shape[0]
    for j in range(first, n_touched):     # every row requested before the first is scored (services/index/_prefetch)
        prefetch_row(keys, touched[j])
    # the first head's scores in the tight loop of beam_search_one (independent key reads the core overlaps), then
    # the other heads' while those keys are in cache
    for j in range(first, n_touched):
        seen[j, 0] = dot(keys[touched[j]], queries[0])
    for j in range(first, n_touched):
        row = keys[touched[j]]
        for h in range(1, g):
            seen[j, h] = dot(row, queries[h])
    for j in range(first, n_touched):
        entered = False
        best = -np.inf
        for h in range(g):
            s = seen[j, h]
            size = sizes[h]
            if size < beam:
                ids[h, size], scores[h, size] = touched[j], s
                _sift_up_row(ids, scores, h, size)
                sizes[h] = size + 1
                entered = True
            elif s > scores[h, 0]:
                ids[h, 0], scores[h, 0] = touched[j], s
                _sift_down_row(ids, scores, h, size, 0)
                entered = True
            c = s * weights[h]
            if c > best:
                best = c
        if entered:
            queue[queued], queue_neg[queued] = j, -best
            _sift_up(queue, queue_neg, queued)
            queued += 1
    return queued


@njit(nogil=True, cache=True, fastmath=True)
def beam_search_group(keys, offsets, targets, entries, queries, weights, beam, visited, touched, seen, ids, scores,
                      sizes, queue, queue_neg):
    """The ``g`` queries ``[g, D]`` of one GQA group searched in one best-first traversal on ``keys`` (float32, or the
    int8 codes with the queries scaled by their step), ``weights`` the heads' ``_weights`` (of the exact queries); returns
    ``(scanned, n_touched)``. Each key is read once and scored against every head; each head keeps its own beam
    (``ids``/``scores[h, :sizes[h]]``, sorted by descending score on return), as ``beam_search_one`` would. The queue
    is ordered by a combined score, the best over heads of each head's score scaled to the first head's query norm
    (so that a head whose query is larger does not steer alone). A key is expanded while it may still enter some
    head's beam (that beam has room or the key scores at least its worst); the search stops when the queue's best
    combined score is below every full head's worst, so scaled. ``scanned`` counts keys read, once for the group."""
    g = queries.shape[0]
    sizes[:] = 0
    n_touched = 0
    for i in range(entries.shape[0]):
        nb = entries[i]
        if not visited[nb]:
            visited[nb] = 1
            touched[n_touched] = nb
            n_touched += 1
    queued = _score_group(0, n_touched, keys, queries, touched, seen, weights, beam, ids, scores, sizes, queue,
                          queue_neg, 0)
    while queued > 0:
        place, node_score = queue[0], -queue_neg[0]
        queued -= 1
        queue[0], queue_neg[0] = queue[queued], queue_neg[queued]
        _sift_down(queue, queue_neg, queued, 0)
        floor = np.inf
        useful = False
        for h in range(g):
            if sizes[h] < beam:
                floor, useful = -np.inf, True
                break
            floor = min(floor, scores[h, 0] * weights[h])
            if seen[place, h] >= scores[h, 0]:
                useful = True
        if node_score < floor:
            break                     # every key left in the queue is worse than every full beam's worst
        if not useful:
            continue
        node = touched[place]
        first = n_touched
        n_touched = mark_unvisited(node, offsets, targets, visited, touched, n_touched)
        queued = _score_group(first, n_touched, keys, queries, touched, seen, weights, beam, ids, scores, sizes,
                              queue, queue_neg, queued)
        if queued > 0:            # the next node's neighbour list, likely the next one expanded
            nxt = touched[queue[0]]
            prefetch_item(targets, offsets[nxt])
    for h in range(g):
        size = sizes[h]
        order = np.argsort(-scores[h, :size])
        ids[h, :size], scores[h, :size] = ids[h, :size][order], scores[h, :size][order]
    return n_touched, n_touched


@njit(nogil=True, cache=True)
def _one_group(nav, step, keys, offsets, targets, entries, queries, beam, exact_nav, q, visited, touched, seen, ids,
               scores, sizes, queue, queue_neg):
    """One group ``queries`` ``[g, D]`` searched on ``nav`` (``q`` ``[g, D]`` scratch: the queries scaled by ``step``),
    then each head's beam rescored with the exact ``keys`` unless ``exact_nav``; returns ``(scanned, n_touched)``."""
    for h in range(queries.shape[0]):
        q[h] = queries[h] * step
    scanned, n_touched = beam_search_group(nav, offsets, targets, entries, q, _weights(queries), beam, visited, touched,
                                           seen, ids, scores, sizes, queue, queue_neg)
    if not exact_nav:
        for h in range(queries.shape[0]):
            rescore(keys, queries[h], ids[h], scores[h], sizes[h])
    return scanned, n_touched


@njit(nogil=True, cache=True)
def search_group_batch(nav, step, keys, offsets, targets, entries, queries, beam, k, exact_nav, out_ids, out_scores,
                       out_scanned):
    """Search every group of ``queries`` ``[B, g, D]`` together (``beam_search_group``) on ``nav``, each head's beam
    rescored with ``keys`` unless ``exact_nav``: ``out_ids`` int64 ``[B, g, k]`` (-1 past a beam's keys),
    ``out_scores`` float32 ``[B, g, k]`` (exact), ``out_scanned`` int64 ``[B]`` (keys the traversal read for the
    group). ``beam >= k``."""
    visited, touched, seen, ids, scores, sizes, queue, queue_neg = group_scratch(nav.shape[0], queries.shape[1], beam)
    search_group_batch_into(nav, step, keys, offsets, targets, entries, queries, beam, k, exact_nav, out_ids,
                            out_scores, out_scanned, visited, touched, seen, ids, scores, sizes, queue, queue_neg)


@njit(nogil=True, cache=True)
def search_group_batch_into(nav, step, keys, offsets, targets, entries, queries, beam, k, exact_nav, out_ids,
                            out_scores, out_scanned, visited, touched, seen, ids, scores, sizes, queue, queue_neg):
    """``search_group_batch`` in the caller's ``group_scratch`` (its arrays at least ``nav.shape[0]`` long, ``g`` and
    ``beam`` as the call's; ``visited`` all 0, and all 0 again on return), so that a thread searching again and again
    allocates it once (services/index/scratch.py)."""
    g = queries.shape[1]
    q = np.empty((g, queries.shape[2]), np.float32)
    for b in range(queries.shape[0]):
        scanned, n_touched = _one_group(nav, step, keys, offsets, targets, entries, queries[b], beam, exact_nav, q,
                                        visited, touched, seen, ids, scores, sizes, queue, queue_neg)
        for h in range(g):
            for j in range(k):
                if j < sizes[h]:
                    out_ids[b, h, j], out_scores[b, h, j] = ids[h, j], scores[h, j]
                else:
                    out_ids[b, h, j], out_scores[b, h, j] = -1, -np.inf
        out_scanned[b] = scanned
        for j in range(n_touched):
            visited[touched[j]] = 0


@njit(nogil=True, cache=True)
def search_attend_group(nav, step, keys, offsets, targets, entries, values, queries, beam, k, exact_nav, scale, out,
                        lse, out_scanned):
    """Search every group of ``queries`` ``[B, g, D]`` together (as ``search_group_batch``) and attend each head's top
    ``k`` keys: ``out`` float32 ``[B, g, Dv]`` (the softmax of the head's scaled exact scores over its keys, weighting
    ``values`` ``[N, Dv]``), ``lse`` float32 ``[B, g]`` (natural log of the summed exp of those scaled scores),
    ``out_scanned`` int64 ``[B]`` (keys read for each group). ``beam >= k``."""
    visited, touched, seen, ids, scores, sizes, queue, queue_neg = group_scratch(nav.shape[0], queries.shape[1], beam)
    search_attend_group_into(nav, step, keys, offsets, targets, entries, values, queries, beam, k, exact_nav, scale,
                             out, lse, out_scanned, visited, touched, seen, ids, scores, sizes, queue, queue_neg)


@njit(nogil=True, cache=True)
def search_attend_group_into(nav, step, keys, offsets, targets, entries, values, queries, beam, k, exact_nav, scale,
                             out, lse, out_scanned, visited, touched, seen, ids, scores, sizes, queue, queue_neg):
    """``search_attend_group`` in the caller's ``group_scratch``, as ``search_group_batch_into``."""
    g = queries.shape[1]
    q = np.empty((g, queries.shape[2]), np.float32)
    acc = np.empty(values.shape[1], np.float64)
    for b in range(queries.shape[0]):
        scanned, n_touched = _one_group(nav, step, keys, offsets, targets, entries, queries[b], beam, exact_nav, q,
                                        visited, touched, seen, ids, scores, sizes, queue, queue_neg)
        for h in range(g):
            lse[b, h] = attend_one(ids[h], scores[h], min(k, sizes[h]), values, scale, acc, out[b, h])
        out_scanned[b] = scanned
        for j in range(n_touched):
            visited[touched[j]] = 0
