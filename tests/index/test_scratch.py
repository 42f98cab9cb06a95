"""A thread's reused search scratch (services/index/scratch.py): searches of indexes of different sizes, one after
another in one thread's scratch, answer exactly as searches that allocate their own; a search that raises drops the
thread's scratch; threads keep scratch of their own; a thread holds one set a kind, grown, whatever beams and groups
it is asked for."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from services.index import AttentionIndex, scratch
from services.index._search import search_attend
from services.index._search_group import search_attend_group


def _normal(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _fresh_group(index: AttentionIndex, values: np.ndarray, q: np.ndarray, k: int, beam: int):
    """The compiled grouped search-and-attend with scratch of its own (what AttentionIndex did before reusing it)."""
    gr = index.graph
    b, g, _ = q.shape
    out, lse, read = np.empty((b, g, values.shape[1]), np.float32), np.empty((b, g), np.float32), np.empty(b, np.int64)
    search_attend_group(index.compact.codes, index.compact.step, index.keys, gr.offsets, gr.targets, gr.entries,
                        values, q, beam, k, False, 0.1, out, lse, read)
    return out, lse, read


def _fresh_one(index: AttentionIndex, values: np.ndarray, q: np.ndarray, k: int, beam: int):
    gr = index.graph
    b = q.shape[0]
    out, lse, read = np.empty((b, values.shape[1]), np.float32), np.empty(b, np.float32), np.empty(b, np.int64)
    search_attend(index.compact.codes, index.compact.step, index.keys, gr.offsets, gr.targets, gr.entries, values, q,
                  beam, k, False, 0.1, out, lse, read)
    return out, lse, read


def test_searches_in_one_threads_scratch_answer_as_fresh_ones():
    # a large index, then a smaller one (views of the grown arrays), then the large one again, twice each: any visited
    # mark a search left behind would change the next one's traversal
    small, large = (AttentionIndex.build(_normal(s, (n, 24)), _normal(s + 1, (90, 24)))
                    for s, n in ((1, 301), (3, 977)))
    values = {id(i): _normal(7, (i.num_keys, 8)) for i in (small, large)}
    # first a wider group and a larger beam: the searches below run in views of a set larger than they need
    large.attend_group(_normal(5, (2, 4, 24)), values[id(large)], 6, 0.1, beam=40)
    large.attend(_normal(6, (2, 24)), values[id(large)], 6, 0.1, beam=40)
    for rnd, index in enumerate((large, small, large, small, large)):
        q = _normal(20 + rnd, (5, 3, 24))
        out, lse, read = index.attend_group(q, values[id(index)], 6, 0.1, beam=16)
        f_out, f_lse, f_read = _fresh_group(index, values[id(index)], q, 6, 16)
        np.testing.assert_array_equal(read, f_read)
        np.testing.assert_array_equal(out, f_out)
        np.testing.assert_array_equal(lse, f_lse)
        q1 = _normal(40 + rnd, (4, 24))
        out, lse, read = index.attend(q1, values[id(index)], 6, 0.1, beam=16)
        f_out, f_lse, f_read = _fresh_one(index, values[id(index)], q1, 6, 16)
        np.testing.assert_array_equal(read, f_read)
        np.testing.assert_array_equal(out, f_out)
        np.testing.assert_array_equal(lse, f_lse)
    visited = scratch.group(large.num_keys, 3, 16)[0]
    assert visited.shape == (large.num_keys,) and not visited.any()


def test_a_search_that_raises_drops_the_threads_scratch():
    scratch.group(50, 2, 8)[0][3] = 1          # a mark left behind, as a search stopped midway would leave it
    assert scratch.held_bytes() > 0
    with pytest.raises(RuntimeError, match="stopped"), scratch.searching():
        raise RuntimeError("stopped")
    assert scratch.held_bytes() == 0
    assert not scratch.group(50, 2, 8)[0].any()


def test_each_thread_has_scratch_of_its_own():
    mine = scratch.group(64, 2, 8)
    theirs = []
    t = threading.Thread(target=lambda: theirs.append(scratch.group(64, 2, 8)))
    t.start()
    t.join()
    assert not np.shares_memory(mine[0], theirs[0][0]) and not np.shares_memory(mine[2], theirs[0][2])
    again = scratch.group(32, 2, 8)              # a smaller index: views of the same arrays
    assert np.shares_memory(again[0], mine[0]) and again[0].shape == (32,)


def test_a_thread_holds_one_set_a_kind_whatever_the_beams_and_groups():
    with pytest.raises(RuntimeError), scratch.searching():     # start from no sets
        raise RuntimeError("reset")
    for beam in range(8, 200, 7):
        for g in (1, 2, 4, 3):
            scratch.group(500, g, beam)
        scratch.one(500, beam)
    largest = scratch.held_bytes()
    # one group set of 500 keys, 4 heads and beam 197, and one single-query set of 500 keys and beam 197
    assert largest == (500 * (1 + 8 + 16 + 8 + 4) + 4 * 197 * (8 + 4) + 4 * 8) + (500 * (1 + 8 + 8 + 4) + 197 * 12)
