"""A GQA group's query heads searched in one traversal (services/index/_search_group.py, ``AttentionIndex.search_group``
and ``attend_group``): with one head it is the single search id for id; with a beam covering every key each head's
top-k is exact; attention is each head's exact attention over the ids it found; ``IndexSet`` answers with it."""

from __future__ import annotations

import numpy as np
import pytest

from services.index import AttentionIndex
from services.index._search_group import search_group_batch
from services.index.heads import IndexSet

from .helpers import exact_attention, random_heads


def _normal(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.fixture(scope="module")
def built():
    """800 keys (dim 32) and their values; training and searched queries shifted off the keys' distribution."""
    shift = _normal(1, (1, 32))
    keys, values = _normal(0, (800, 32)), _normal(2, (800, 24))
    return AttentionIndex.build(keys, 2.0 * _normal(3, (1200, 32)) + shift, threads=1), keys, values, shift


def _groups(shift, b, g, seed=4):
    """[b, g, D] queries of differing norms (one head's may be several times another's)."""
    scale = np.random.default_rng(seed).uniform(0.5, 4.0, (b, g, 1)).astype(np.float32)
    return (scale * (_normal(seed, (b, g, shift.shape[1])) + shift)).astype(np.float32)


@pytest.mark.parametrize("k, beam", [(1, None), (10, 40), (100, None), (100, 300)], ids=["k1", "k10-beam40", "k100",
                                                                                        "k100-beam300"])
def test_one_head_is_the_single_search_exactly(built, k, beam):
    index, _, values, shift = built
    q = _groups(shift, 9, 1)
    ids, scanned = index.search_group(q, k, beam=beam)
    want_ids, want_scanned = index.search(q[:, 0], k, beam=beam)
    np.testing.assert_array_equal(ids[:, 0], want_ids)
    np.testing.assert_array_equal(scanned, want_scanned)
    out, lse, scanned = index.attend_group(q, values, k, 0.2, beam=beam)
    want_out, want_lse, want_scanned = index.attend(q[:, 0], values, k, 0.2, beam=beam)
    np.testing.assert_array_equal(out[:, 0], want_out)
    np.testing.assert_array_equal(lse[:, 0], want_lse)
    np.testing.assert_array_equal(scanned, want_scanned)


@pytest.mark.parametrize("g", [1, 3, 4], ids=["G1", "G3", "G4"])
def test_a_beam_covering_every_key_gives_every_head_its_exact_top_k(built, g):
    """The compiled traversal itself (the API answers beam >= N without it): every reachable key is read once for the
    group, and each head's beam holds its own exact top k."""
    index, keys, _, shift = built
    q, n, k = _groups(shift, 5, g), index.num_keys, 50
    gr = index.graph
    ids, scores = np.empty((5, g, k), np.int64), np.empty((5, g, k), np.float32)
    scanned = np.empty(5, np.int64)
    codes = index.compact
    search_group_batch(codes.codes, codes.step, index.keys, gr.offsets, gr.targets, gr.entries, q, n, k, False, ids,
                       scores, scanned)
    assert (scanned == n).all()
    exact = np.einsum("bgd,nd->bgn", q.astype(np.float64), keys.astype(np.float64))
    want = np.argsort(-exact, axis=2)[:, :, :k]
    np.testing.assert_array_equal(ids, want)
    np.testing.assert_allclose(scores, np.take_along_axis(exact, want, 2), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("g", [1, 3, 4], ids=["G1", "G3", "G4"])
@pytest.mark.parametrize("k, beam", [(10, 40), (50, None), (1000, None)], ids=["k10-beam40", "k50", "k-over"])
def test_attend_group_is_each_heads_attention_over_its_ids(built, g, k, beam):
    index, keys, values, shift = built
    q = _groups(shift, 6, g, seed=7)
    ids, scanned = index.search_group(q, k, beam=beam)
    out, lse, got_scanned = index.attend_group(q, values, k, 0.15, beam=beam)
    assert out.shape == (6, g, 24) and lse.shape == (6, g) and out.dtype == lse.dtype == np.float32
    want_out, want_lse = exact_attention(q.reshape(6 * g, -1), keys, values, ids.reshape(6 * g, k), 0.15)
    np.testing.assert_allclose(out.reshape(6 * g, -1), want_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse.reshape(-1), want_lse, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got_scanned, scanned)
    for row in ids.reshape(6 * g, k):                       # each head's own unique keys, -1 only past N
        kept = row[row >= 0]
        assert len(set(kept.tolist())) == len(kept) == min(k, index.num_keys)
    if k >= index.num_keys:
        assert (scanned == index.num_keys).all()
    else:       # fewer keys read for the group than its heads' own searches read together
        assert scanned.sum() <= index.search(q.reshape(6 * g, -1), k, beam=beam)[1].sum()


@pytest.mark.parametrize("n, k", [(1, 1), (5, 3), (5, 8), (40, 10), (40, 100)], ids=["N1", "N5-k3", "N5-k8", "N40-k10",
                                                                                     "N40-k100"])
def test_small_indexes_and_k_over_n(n, k):
    keys, values = _normal(10, (n, 16)), _normal(11, (n, 8))
    index = AttentionIndex.build(keys, _normal(12, (30, 16)), threads=1)
    q = _normal(13, (3, 4, 16))
    ids, scanned = index.search_group(q, k, beam=max(k, 4))
    assert ids.shape == (3, 4, k)
    exact = np.argsort(-(q @ keys.T), axis=2, kind="stable")[:, :, : min(k, n)]
    if k >= n:
        np.testing.assert_array_equal(ids[:, :, :n], exact)
        assert (ids[:, :, n:] == -1).all() and (scanned == n).all()
    out, lse, _ = index.attend_group(q, values, k, 0.25, beam=max(k, 4))
    want_out, want_lse = exact_attention(q.reshape(12, -1), keys, values, ids.reshape(12, k), 0.25)
    np.testing.assert_allclose(out.reshape(12, -1), want_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse.reshape(-1), want_lse, rtol=1e-5, atol=1e-5)


def test_group_queries_are_checked(built):
    index, _, values, _ = built
    with pytest.raises(ValueError, match="3-D"):
        index.search_group(np.zeros((2, 32), np.float32))
    with pytest.raises(ValueError, match="dim"):
        index.search_group(np.zeros((2, 3, 31), np.float32))
    with pytest.raises(ValueError, match="beam"):
        index.attend_group(np.zeros((1, 2, 32), np.float32), values, 50, 0.1, beam=10)
    ids, scanned = index.search_group(np.zeros((0, 4, 32), np.float32), 5)
    assert ids.shape == (0, 4, 5) and scanned.shape == (0,)


@pytest.mark.parametrize("threads", [1, 7], ids=["one-thread", "pieces"])
def test_index_set_searching_groups_answers_as_per_head_search_where_both_are_exact(threads):
    """With k over every key both paths attend every key: the same answer to fp32 tolerance, whatever the pieces; the
    grouped path reads a KV head's keys once for its piece of query heads."""
    hkv, n, d, hq = 2, 300, 16, 8
    keys, values, train, q = random_heads(5, hkv, n, d, m=200, b=2, hq=hq)
    grouped, per_head = IndexSet(threads=threads), IndexSet(threads=threads, group_search=False)
    try:
        for ix in (grouped, per_head):
            ix.add("a", 0, keys, values, train)
            ix.add("b", 0, keys[:, :250], values[:, :250], train)
        got = grouped.attend(0, ["a", "b"], q, n, 0.3)
        want = per_head.attend(0, ["a", "b"], q, n, 0.3)
        np.testing.assert_allclose(got.out, want.out, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got.lse, want.lse, rtol=1e-5, atol=1e-5)
        pieces = 1 if threads == 1 else 2       # 4 pairs for 7 threads: each KV head's 4 query heads in 2 pieces
        assert got.scanned.tolist() == [hkv * pieces * 300, hkv * pieces * 250]
        assert want.scanned.tolist() == [hq * 300, hq * 250]
    finally:
        grouped.close()
        per_head.close()
