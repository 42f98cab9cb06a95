"""Compiled loop of a whole scan: every key scored against a GQA group's query heads, on the int8 codes, each head
keeping its best ``beam`` by code score; then each beam is rescored with the exact keys (``_search.rescore``) and the
top ``k`` attended (``_search.attend_one``), as a graph search's beam is.

Why: a graph search reads its keys at random, one cache miss a key; a scan reads them in order. Where a graph must
read a large share of the keys anyway (keys with no structure for the graph to use: the random keys of the decode
benchmarks read 37-40% of them for a query group, at recall@100 0.5-0.6), scanning them all costs less and finds the
exact top keys up to the codes' rounding: at 31,680 random 128-dim keys, a group of 4 heads on one core of this
repository's machine, 1.65 ms a scan (recall@100 1.000) against 1.69 ms a graph search that read 40% of them (recall
0.570); at 8,192 keys 0.61 against 1.03 ms (bench/index/README.md, "Scans").
``heads.IndexSet`` picks a head's scan when its graph searches read at least ``SCAN_SHARE`` of its keys.

Invariants: those of ``_search`` (``codes`` int8 ``[N, D]`` and ``step`` float32 ``[D]``, the exact ``keys``); ``nogil``,
its state in arrays allocated per call.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from services.index._search import attend_one, rescore
from services.index._search_group import _sift_down_row, _sift_up_row

TILE = 256     # keys scored for every head before the heads' beams take them (the tile's scores stay in cache)


@njit(nogil=True, cache=True, fastmath=True)
def _score_tile(codes, q, i0, i1, row, tile):
    """Keys [i0, i1)'s code scores against each head's scaled query ``q`` [g, D] into ``tile[h, :i1 - i0]``."""
    g, d = q.shape
    for i in range(i0, i1):
        codes_i = codes[i]
        for t in range(d):              # the key's codes widened once, then a dot a head
            row[t] = codes_i[t]
        for h in range(g):
            acc = np.float32(0.0)
            for t in range(d):
                acc += row[t] * q[h, t]
            tile[h, i - i0] = acc


@njit(nogil=True, cache=True)
def _offer_tile(i0, i1, tile, beam, ids, scores, sizes):
    """Each head's scores of keys [i0, i1) offered to its beam (a min-heap of at most ``beam``)."""
    for h in range(tile.shape[0]):
        for i in range(i0, i1):
            v = tile[h, i - i0]
            size = sizes[h]
            if size < beam:
                ids[h, size], scores[h, size] = i, v
                _sift_up_row(ids, scores, h, size)
                sizes[h] = size + 1
            elif v > scores[h, 0]:
                ids[h, 0], scores[h, 0] = i, v
                _sift_down_row(ids, scores, h, size, 0)


@njit(nogil=True, cache=True)
def scan_group(codes, step, queries, beam, ids, scores, sizes, tile):
    """Every key's code score against each of ``queries`` ``[g, D]`` (scaled by ``step``); head h's best ``beam`` by
    that score in ``ids``/``scores[h, :sizes[h]]`` (a min-heap, unsorted); ``tile`` float32 ``[g, TILE]`` scratch.
    NOTE: scoring and offering are two compiled functions, not one loop nest: so the scoring loop vectorises
    (one function took 2.25 ms a 31,680-key scan of 4 heads on this repository's machine, two 1.33 ms)."""
    g, d = queries.shape
    n = codes.shape[0]
    q = np.empty((g, d), np.float32)
    for h in range(g):
        for t in range(d):
            q[h, t] = queries[h, t] * step[t]
        sizes[h] = 0
    row = np.empty(d, np.float32)
    for i0 in range(0, n, TILE):
        i1 = min(n, i0 + TILE)
        _score_tile(codes, q, i0, i1, row, tile)
        _offer_tile(i0, i1, tile, beam, ids, scores, sizes)


@njit(nogil=True, cache=True)
def scan_attend_group(codes, step, keys, values, queries, beam, k, scale, out, lse):
    """Every group of ``queries`` ``[B, g, D]`` scanned (``attend_group(scan=True)``), each head's beam rescored with ``keys`` and
    its top ``k`` attended: ``out`` float32 ``[B, g, Dv]``, ``lse`` float32 ``[B, g]``. ``beam >= k``."""
    b, g, _ = queries.shape
    ids = np.empty((g, beam), np.int64)
    scores = np.empty((g, beam), np.float32)
    sizes = np.zeros(g, np.int64)
    tile = np.empty((g, TILE), np.float32)
    acc = np.empty(values.shape[1], np.float64)
    for r in range(b):
        scan_group(codes, step, queries[r], beam, ids, scores, sizes, tile)
        for h in range(g):
            rescore(keys, queries[r, h], ids[h], scores[h], sizes[h])
            lse[r, h] = attend_one(ids[h], scores[h], min(k, sizes[h]), values, scale, acc, out[r, h])
