"""A decode layer's grouped searches in one compiled call: every piece (a KV head's index and some of its query
heads) searched and attended on numba's own threads (``prange``), with no Python between them.

Why: on a 16-core host a layer's 16 searches took 3.3-4.1 ms on a thread pool against 0.95-2.06 ms for the longest
one alone (bench/index/README.md): each piece's start waits for the interpreter lock and a thread's wake-up.

Invariants: those of ``_search_group`` for each piece; every index compact (int8 codes navigated, exact keys
rescored); the pieces' query groups of one size ``g``; ``head_of[p]`` the place of piece p's index in the typed
lists; the scratch stacked a piece (``[P, ...]``, each as ``group_scratch``'s, ``visited`` all 0, and all 0 again on
return). NOTE: numba's default threading layer (workqueue) must not be entered by two threads at once: callers
hold one lock around the call.
"""

from __future__ import annotations

from numba import njit, prange

from services.index._search_group import search_attend_group_into


@njit(nogil=True, parallel=True, cache=True)
def attend_pieces(navs, steps, keyss, offsets, targets, entries, values, head_of, queries, beam, k, scale, out, lse,
                  scanned, visited, touched, seen, ids, scores, sizes, queue, queue_neg):
    """Piece p's queries ``queries[p]`` ``[g, D]`` searched in index ``head_of[p]`` and its top ``k`` attended:
    ``out[p]`` ``[g, Dv]``, ``lse[p]`` ``[g]``, ``scanned[p]`` (keys its traversal read), as
    ``search_attend_group_into`` answers for one group."""
    for p in prange(queries.shape[0]):
        h = head_of[p]
        search_attend_group_into(navs[h], steps[h], keyss[h], offsets[h], targets[h], entries[h], values[h],
                                 queries[p:p + 1], beam, k, False, scale, out[p:p + 1], lse[p:p + 1],
                                 scanned[p:p + 1], visited[p], touched[p], seen[p], ids[p], scores[p], sizes[p],
                                 queue[p], queue_neg[p])
