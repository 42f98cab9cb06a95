"""Compiled loops of the attention index's build: occlusion pruning, graph searches for candidates and
repairs, reachability. The pipeline that calls them is ``graph.build_graph``.

Same array conventions as ``_search.py``. Candidate lists are CSR too (``c_offsets`` int64 ``[N + 1]``,
``c_targets`` int64) and may repeat ids or hold the node itself: ``prune`` drops both. Every loop covers
a range ``[lo, hi)`` of its items so that the pipeline can run ranges on threads (all are ``nogil``);
results depend only on the range, never on the thread.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from services.index._search import beam_search_one, dot, mark_unvisited, scratch


@njit(nogil=True, cache=True, fastmath=True)
def prune(keys, sq_norms, node, cands, degree, alpha, out) -> int:
    """Occlusion rule, in the keys' own geometry: candidates in order of L2 distance to ``node``; a candidate
    c is dropped when a kept s has ``alpha * |c - s|^2 < |c - node|^2`` (s lies between: a search at
    ``node`` reaches c through s). At most ``degree`` kept into ``out``; returns how many.

    NOTE: the rule measures keys against keys, never against queries: keys share one distribution, so L2
    is their geometry, while the query side of the index comes from which candidates exist at all (keys
    that training queries rank together). Ordering and occluding by inner product instead left layer-0
    heads with ~3 edges a key and lost recall (bench/index/README.md)."""
    n = cands.shape[0]
    dist = np.empty(n, np.float32)
    x = keys[node]
    for i in range(n):
        c = cands[i]
        dist[i] = sq_norms[c] + sq_norms[node] - 2.0 * dot(keys[c], x)
    order = np.argsort(dist, kind="mergesort")
    kept = 0
    for oi in range(n):
        i = order[oi]
        c = cands[i]
        if c == node:
            continue
        occluded = False
        for j in range(kept):
            s = out[j]
            if s == c:
                occluded = True
                break
            d_cs = sq_norms[c] + sq_norms[s] - 2.0 * dot(keys[c], keys[s])
            if alpha * d_cs < dist[i]:
                occluded = True
                break
        if not occluded:
            out[kept] = c
            kept += 1
            if kept == degree:
                break
    return kept


@njit(nogil=True, cache=True)
def prune_range(keys, sq_norms, c_offsets, c_targets, degree, alpha, lo, hi):
    """Prune the candidate lists of nodes ``[lo, hi)``: ``(counts int64 [hi - lo], adj int32 [hi - lo, degree])``."""
    counts = np.zeros(hi - lo, np.int64)
    adj = np.full((hi - lo, degree), -1, np.int32)
    out = np.empty(degree, np.int64)
    for node in range(lo, hi):
        a, b = c_offsets[node], c_offsets[node + 1]
        if b > a:
            kept = prune(keys, sq_norms, node, c_targets[a:b], degree, alpha, out)
            for j in range(kept):
                adj[node - lo, j] = out[j]
            counts[node - lo] = kept
    return counts, adj


@njit(nogil=True, cache=True)
def search_candidates(keys, offsets, targets, entries, beam, lo, hi):
    """For keys ``[lo, hi)``: a search of the graph with the key itself as the query; the beams as candidate
    pairs ``(src, dst)`` int64."""
    n = keys.shape[0]
    visited, touched, ids, scores, queue, queue_neg = scratch(n, beam)
    src = np.empty((hi - lo) * beam, np.int64)
    dst = np.empty((hi - lo) * beam, np.int64)
    m = 0
    for node in range(lo, hi):
        size, _, n_touched = beam_search_one(keys, offsets, targets, entries, keys[node], beam, visited, touched,
                                             ids, scores, queue, queue_neg)
        for j in range(size):
            src[m], dst[m] = node, ids[j]
            m += 1
        for j in range(n_touched):
            visited[touched[j]] = 0
    return src[:m], dst[:m]


@njit(nogil=True, cache=True, fastmath=True)
def repair_pairs(keys, sq_norms, offsets, targets, entries, queries, lists, beam, lo, hi):
    """Training queries ``[lo, hi)`` searched on the graph as it stands; each key of a query's exact list
    (``lists`` int64 ``[M, P]``) that the search never scored becomes an edge ``(src, dst)`` from the scored
    key of the same list nearest to it (L2), or from the search's best key when none of the list was scored.
    These are the edges a search for that query lacked."""
    n = keys.shape[0]
    p = lists.shape[1]
    visited, touched, ids, scores, queue, queue_neg = scratch(n, beam)
    src = np.empty((hi - lo) * p, np.int64)
    dst = np.empty((hi - lo) * p, np.int64)
    m = 0
    for t in range(lo, hi):
        _, _, n_touched = beam_search_one(keys, offsets, targets, entries, queries[t], beam, visited, touched,
                                          ids, scores, queue, queue_neg)
        for j in range(p):
            c = lists[t, j]
            if visited[c]:
                continue
            best, best_d = ids[0], np.inf
            for i in range(p):
                f = lists[t, i]
                if f != c and visited[f]:
                    d = sq_norms[c] + sq_norms[f] - 2.0 * dot(keys[c], keys[f])
                    if d < best_d:
                        best, best_d = f, d
            src[m], dst[m] = best, c
            m += 1
        for j in range(n_touched):
            visited[touched[j]] = 0
    return src[:m], dst[:m]


@njit(nogil=True, cache=True)
def _mark_from(offsets, targets, start, seen, stack) -> None:
    """Mark in ``seen`` every key a path from ``start`` reaches (depth first; ``stack`` [N] is scratch)."""
    seen[start] = 1
    stack[0] = start
    top = 1
    while top > 0:
        top -= 1
        top = mark_unvisited(stack[top], offsets, targets, seen, stack, top)


@njit(nogil=True, cache=True)
def reachable(offsets, targets, entries):
    """uint8 ``[N]``: 1 where a path from one of ``entries`` reaches the key."""
    n = offsets.shape[0] - 1
    seen = np.zeros(n, np.uint8)
    stack = np.empty(n, np.int64)
    for i in range(entries.shape[0]):
        if not seen[entries[i]]:
            _mark_from(offsets, targets, entries[i], seen, stack)
    return seen


@njit(nogil=True, cache=True)
def link_unreachable(keys, sq_norms, offsets, targets, entries, beam):
    """Edges ``(src, dst)`` that make every key reachable from ``entries``: each key still unreached is searched
    for (itself as the query, on the reachable part) and linked from the nearest key (L2) of that search's
    beam; whatever it reaches then counts as reached. The searches see the graph without these links, so
    every beam key is one reached from the start."""
    n = keys.shape[0]
    seen = reachable(offsets, targets, entries)
    visited, touched, ids, scores, queue, queue_neg = scratch(n, beam)
    stack = np.empty(n, np.int64)
    src = np.empty(n, np.int64)
    dst = np.empty(n, np.int64)
    m = 0
    for u in range(n):
        if seen[u]:
            continue
        size, _, n_touched = beam_search_one(keys, offsets, targets, entries, keys[u], beam, visited, touched,
                                             ids, scores, queue, queue_neg)
        for j in range(n_touched):
            visited[touched[j]] = 0
        best, best_d = entries[0], np.inf
        for j in range(size):
            f = ids[j]
            d = sq_norms[u] + sq_norms[f] - 2.0 * dot(keys[u], keys[f])
            if d < best_d:
                best, best_d = f, d
        src[m], dst[m] = best, u
        m += 1
        _mark_from(offsets, targets, u, seen, stack)     # everything u reaches is now reached
    return src[:m], dst[:m]


@njit(nogil=True, cache=True)
def absent_pairs(offsets, targets, src, dst):
    """bool ``[P]``: pair i is not an edge yet (``dst[i]`` is not among ``src[i]``'s targets)."""
    out = np.ones(src.shape[0], np.bool_)
    for i in range(src.shape[0]):
        s, d = src[i], dst[i]
        for j in range(offsets[s], offsets[s + 1]):
            if targets[j] == d:
                out[i] = False
                break
    return out


@njit(nogil=True, cache=True)
def append_edges(offsets, targets, src, dst):
    """The CSR with pair i's target added after ``src[i]``'s own targets, the pairs of a source in their order:
    (offsets int64 ``[N + 1]``, targets int32). One pass over the edges: no sort of them."""
    n = offsets.shape[0] - 1
    added = np.zeros(n, np.int64)
    for i in range(src.shape[0]):
        added[src[i]] += 1
    new_offsets = np.empty(n + 1, np.int64)
    new_offsets[0] = 0
    for v in range(n):
        new_offsets[v + 1] = new_offsets[v] + (offsets[v + 1] - offsets[v]) + added[v]
    out = np.empty(new_offsets[n], np.int32)
    cursor = np.empty(n, np.int64)
    for v in range(n):
        at = new_offsets[v]
        for j in range(offsets[v], offsets[v + 1]):
            out[at] = targets[j]
            at += 1
        cursor[v] = at
    for i in range(src.shape[0]):
        out[cursor[src[i]]] = dst[i]
        cursor[src[i]] += 1
    return new_offsets, out
