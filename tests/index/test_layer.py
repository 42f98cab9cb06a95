"""A layer's searches in one compiled call (services/index/_layer.py, ``IndexSet(compiled=True)``, the default): the
same answers, bit for bit, as the thread pool's searches (``compiled=False``) for one row and for several owners, at
every piece size, heads scanned whole included; the pool where the compiled call does not apply (an owner with no
keys at the layer, an index no larger than the beam, pieces of unequal size), still answering alike; callers on several threads
and index sets at once; scratch a thread, not a piece, grown for a larger index and reused for a smaller one; an owner dropped and added
while searched; malformed calls (wrong head_dim, beam under k, an unknown owner, non-finite queries) refused alike on
both paths, which serve on (and answer a call of no rows with nothing); a batch's nested lists kept, made again when an owner's keys change, bounded, and
dropped with an owner."""

from __future__ import annotations

import threading

import numba
import numpy as np
import pytest

from services.index import _layer
from services.index import heads as heads_mod
from services.index.heads import IndexSet


def _normal(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.fixture(autouse=True)
def compiled_ready():
    """The compiled call ready before each test (else the first searches of a process use the pool while it compiles)."""
    _layer.warm()
    assert _layer.ready()


@pytest.fixture
def counted(monkeypatch):
    """How many compiled layer calls ran (so that a test knows which path answered)."""
    calls = []
    real = _layer.attend

    def attend(*args, **kwargs):
        calls.append(len(args[3]))
        return real(*args, **kwargs)

    monkeypatch.setattr(_layer, "attend", attend)
    return calls


def _pair(threads: int, **kwargs) -> tuple[IndexSet, IndexSet]:
    return IndexSet(threads=threads, **kwargs), IndexSet(threads=threads, compiled=False, **kwargs)


def _assert_same(got, want):
    np.testing.assert_array_equal(got.out, want.out)
    np.testing.assert_array_equal(got.lse, want.lse)
    np.testing.assert_array_equal(got.scanned, want.scanned)


@pytest.mark.parametrize("threads", [1, 4, 16], ids=["whole-groups", "halves", "single-heads"])
def test_the_compiled_call_answers_as_the_pool_bit_for_bit(threads, counted):
    hkv, hq, d = 2, 8, 24
    keys, values = _normal(1, (hkv, 700, d)), _normal(2, (hkv, 700, d))
    train = _normal(3, (hkv, 300, d))
    compiled, pool = _pair(threads, scan_share=None)
    try:
        for ix in (compiled, pool):
            ix.add("a", 0, keys, values, train)
            ix.add("b", 0, keys[:, :500] * 1.5, values[:, :500], train)
            ix.add("c", 0, keys[:, 100:], values[:, 100:], train)
        for rows in (["a"], ["a", "b"], ["c", "a", "b"]):
            q = _normal(len(rows) + threads, (len(rows), hq, d))
            _assert_same(compiled.attend(0, rows, q, 20, 0.25), pool.attend(0, rows, q, 20, 0.25))
        assert len(counted) == 3        # every call compiled: with 1 thread a piece is a KV head's 4 query heads
        assert counted[0] == hkv * {1: 1, 4: 2, 16: 4}[threads]
        assert compiled.calls_by_path() == {"compiled": 3, "pool": 0}      # what /metrics reports
        assert pool.calls_by_path() == {"compiled": 0, "pool": 3}
        # scratch a thread, never more sets than numba has threads, however many pieces (up to 24 here)
        assert all(a[0].shape[0] <= numba.config.NUMBA_NUM_THREADS for a in _layer._SCRATCH.values())
    finally:
        compiled.close()
        pool.close()


def test_the_pool_answers_where_the_compiled_call_does_not_apply(counted, monkeypatch):
    monkeypatch.setattr(heads_mod, "SCAN_CALLS", 2)
    hkv, hq, d = 2, 6, 16
    keys, values = _normal(4, (hkv, 900, d)), _normal(5, (hkv, 900, d))
    train = _normal(6, (hkv, 200, d))
    compiled, pool = _pair(4)
    try:
        for ix in (compiled, pool):
            ix.add("big", 0, keys, values, train)
            ix.add("small", 0, keys[:, :100], values[:, :100], train)        # no larger than the beam (128)
            ix.add("none", 0, keys[:, :0], values[:, :0], train)              # nothing offloaded at this layer
        q = _normal(7, (1, hq, d))
        for rows in (["small"], ["big", "small"], ["none"], ["big", "none"]):
            qs = np.repeat(q, len(rows), axis=0)
            _assert_same(compiled.attend(0, rows, qs, 10, 0.3), pool.attend(0, rows, qs, 10, 0.3))
        assert counted == []
        # 3 query heads a KV head in pieces of 2 and 1 (4 threads, 2 pairs): unequal pieces, the pool
        _assert_same(compiled.attend(0, ["big"], q, 10, 0.3), pool.attend(0, ["big"], q, 10, 0.3))
        assert counted == []
        # random keys: the graph reads widely, so the next two calls scan every key, then the graph again: both
        # paths alike, every call in the compiled one
        wide, wide_pool = _pair(1)
        try:
            for ix in (wide, wide_pool):
                ix.add("a", 0, keys, values, train)
            q4 = _normal(8, (1, 4, d))
            got = [wide.attend(0, ["a"], q4, 10, 0.3) for _ in range(4)]
            for g in got:
                _assert_same(g, wide_pool.attend(0, ["a"], q4, 10, 0.3))
            reads = [int(g.scanned[0]) for g in got]
            assert reads[0] < hkv * 900 and reads[1:3] == [hkv * 900] * 2 and reads[3] == reads[0]
            assert len(counted) == 4
        finally:
            wide.close()
            wide_pool.close()
    finally:
        compiled.close()
        pool.close()


def test_callers_on_several_threads_and_index_sets_at_once_answer_as_alone():
    hkv, hq, d = 2, 8, 16
    sets = []
    want = []
    for s in range(3):
        ix = IndexSet(threads=4, scan_share=None)
        ix.add("a", 0, _normal(10 + s, (hkv, 600, d)), _normal(20 + s, (hkv, 600, d)), _normal(30 + s, (hkv, 200, d)))
        sets.append(ix)
    queries = [_normal(40 + i, (1, hq, d)) for i in range(12)]
    for i, q in enumerate(queries):
        want.append(sets[i % 3].attend(0, ["a"], q, 15, 0.3))
    got: list = [None] * len(queries)

    def work(i: int) -> None:
        got[i] = sets[i % 3].attend(0, ["a"], queries[i], 15, 0.3)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(queries))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        for g, w in zip(got, want):
            _assert_same(g, w)
    finally:
        for ix in sets:
            ix.close()


def test_scratch_grown_for_a_larger_index_serves_a_smaller_one_after_it():
    hkv, hq, d = 2, 4, 16
    compiled, pool = _pair(2, scan_share=None)
    try:
        for ix in (compiled, pool):
            ix.add("small", 0, _normal(50, (hkv, 300, d)), _normal(51, (hkv, 300, d)), _normal(52, (hkv, 100, d)))
            ix.add("large", 0, _normal(53, (hkv, 2500, d)), _normal(54, (hkv, 2500, d)), _normal(55, (hkv, 100, d)))
        q = _normal(56, (1, hq, d))
        for owner in ("small", "large", "small", "large"):
            _assert_same(compiled.attend(0, [owner], q, 10, 0.3), pool.attend(0, [owner], q, 10, 0.3))
        visited = [a[0] for a in _layer._SCRATCH.values()]
        assert max(v.shape[1] for v in visited) >= 2500 and not any(v.any() for v in visited)   # all 0 again
    finally:
        compiled.close()
        pool.close()


def test_a_dropped_or_replaced_owner_leaves_no_compiled_arrays():
    hkv, d = 2, 16
    ix = IndexSet(threads=2)
    try:
        ix.add("a", 0, _normal(60, (hkv, 400, d)), _normal(61, (hkv, 400, d)), _normal(62, (hkv, 100, d)))
        ix.add("a", 1, _normal(63, (hkv, 400, d)), _normal(64, (hkv, 400, d)), _normal(65, (hkv, 100, d)))
        assert set(ix._layer_arrays) == {("a", 0), ("a", 1)}                  # noqa: SLF001
        ix.add("a", 1, _normal(63, (hkv, 0, d)), _normal(64, (hkv, 0, d)), _normal(65, (hkv, 100, d)))
        assert set(ix._layer_arrays) == {("a", 0)}                            # noqa: SLF001
        ix.drop("a")
        assert not ix._layer_arrays                                           # noqa: SLF001
    finally:
        ix.close()


def test_an_owner_dropped_and_added_again_while_searched_leaves_the_set_serving():
    """A search racing a drop answers from the arrays it started with or names the missing owner; nothing else."""
    hkv, hq, d = 2, 8, 16
    keys, values, train = _normal(70, (hkv, 800, d)), _normal(71, (hkv, 800, d)), _normal(72, (hkv, 100, d))
    compiled, pool = _pair(4, scan_share=None)
    q = _normal(73, (1, hq, d))
    errors: list[BaseException] = []
    stop = threading.Event()
    try:
        for ix in (compiled, pool):
            ix.add("a", 0, keys, values, train)
        want = pool.attend(0, ["a"], q, 10, 0.3)

        def search() -> None:
            while not stop.is_set():
                try:
                    _assert_same(compiled.attend(0, ["a"], q, 10, 0.3), want)
                except KeyError as exc:
                    assert "'a'" in str(exc)
                except BaseException as exc:  # noqa: BLE001 - collected for the assertion below
                    errors.append(exc)
                    return

        t = threading.Thread(target=search)
        t.start()
        for _ in range(20):
            compiled.drop("a")
            compiled.add("a", 0, keys, values, train)
        stop.set()
        t.join(timeout=60)
        assert not t.is_alive() and errors == []
        _assert_same(compiled.attend(0, ["a"], q, 10, 0.3), want)
    finally:
        stop.set()
        compiled.close()
        pool.close()


def test_malformed_calls_are_refused_alike_on_both_paths():
    hkv, d = 2, 16
    compiled, pool = _pair(4)
    try:
        for ix in (compiled, pool):
            ix.add("a", 0, _normal(80, (hkv, 400, d)), _normal(81, (hkv, 400, d)), _normal(82, (hkv, 100, d)))
        for ix in (compiled, pool):
            with pytest.raises(ValueError, match="head_dim"):
                ix.attend(0, ["a"], _normal(83, (1, 4, d + 1)), 10, 0.3)
            with pytest.raises(ValueError, match="beam"):
                ix.attend(0, ["a"], _normal(84, (1, 4, d)), 10, 0.3, beam=5)
            with pytest.raises(KeyError, match="'b'"):
                ix.attend(0, ["b"], _normal(85, (1, 4, d)), 10, 0.3)
            q = _normal(86, (1, 4, d))
            q[0, 1, 3] = np.nan                 # never searched: a NaN score would order nothing
            with pytest.raises(ValueError, match="non-finite"):
                ix.attend(0, ["a"], q, 10, 0.3)
            q[0, 1, 3] = np.inf
            with pytest.raises(ValueError, match="non-finite"):
                ix.attend(0, ["a"], q, 10, 0.3)
        q = _normal(87, (1, 4, d))                  # and both serve on
        _assert_same(compiled.attend(0, ["a"], q, 10, 0.3), pool.attend(0, ["a"], q, 10, 0.3))
        for ix in (compiled, pool):                 # a call of no rows: an empty answer
            empty = ix.attend(0, [], np.zeros((0, 4, d), np.float32), 10, 0.3)
            assert empty.out.shape == (0, 4, d) and empty.lse.shape == (0, 4) and empty.scanned.shape == (0,)
    finally:
        compiled.close()
        pool.close()


def test_a_batch_s_nested_lists_are_kept_remade_when_an_owner_changes_and_bounded(monkeypatch):
    hkv, hq, d = 2, 4, 16
    made = []
    real = _layer.nested
    monkeypatch.setattr(_layer, "nested", lambda layers: made.append(len(layers)) or real(layers))
    monkeypatch.setattr(heads_mod, "NESTED_KEPT", 2)
    compiled, pool = _pair(2, scan_share=None)
    try:
        for ix in (compiled, pool):
            for o, seed in (("a", 90), ("b", 91), ("c", 92)):
                ix.add(o, 0, _normal(seed, (hkv, 300, d)), _normal(seed + 10, (hkv, 300, d)),
                       _normal(seed + 20, (hkv, 100, d)))
        q = _normal(93, (2, hq, d))
        for _ in range(3):
            _assert_same(compiled.attend(0, ["a", "b"], q, 10, 0.3), pool.attend(0, ["a", "b"], q, 10, 0.3))
        assert made == [2]                              # made once, then kept
        for ix in (compiled, pool):                     # b's keys replaced: its batches' lists are made again
            ix.add("b", 0, _normal(94, (hkv, 500, d)), _normal(95, (hkv, 500, d)), _normal(96, (hkv, 100, d)))
        _assert_same(compiled.attend(0, ["a", "b"], q, 10, 0.3), pool.attend(0, ["a", "b"], q, 10, 0.3))
        assert made == [2, 2]
        for rows in (["b", "c"], ["a", "c"]):           # two more batches: at most NESTED_KEPT kept, oldest out
            _assert_same(compiled.attend(0, rows, q, 10, 0.3), pool.attend(0, rows, q, 10, 0.3))
        assert list(compiled._nested) == [(("b", "c"), 0), (("a", "c"), 0)]           # noqa: SLF001
        compiled.drop("c")                              # the lists hold an owner's arrays: dropped with it
        assert not compiled._nested                                                     # noqa: SLF001
    finally:
        compiled.close()
        pool.close()
