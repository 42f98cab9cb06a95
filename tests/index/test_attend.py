"""``AttentionIndex.attend`` (services/index/graph.py, the compiled search-and-attend of _search.py): attention over
the keys its search retrieves equals attention computed apart over the ids ``search`` returns; with k covering every
key it is exact attention; bad values are refused."""

from __future__ import annotations

import numpy as np
import pytest

from services.index import AttentionIndex
from services.index.heads import IndexSet


@pytest.fixture(scope="module")
def index():
    rng = np.random.default_rng(3)
    keys = rng.standard_normal((2000, 24)).astype(np.float32)
    train = (rng.standard_normal((600, 24)) + 0.3).astype(np.float32)
    values = rng.standard_normal((2000, 20)).astype(np.float32)
    return AttentionIndex.build(keys, train, threads=1), keys, values


def _attention(q, keys, values, ids, scale):
    logits = np.array([[q[b] @ keys[i] * scale for i in row if i >= 0] for b, row in enumerate(ids)], np.float64)
    top = logits.max(1, keepdims=True)
    p = np.exp(logits - top)
    out = np.stack([(p[b] / p[b].sum()) @ values[[i for i in row if i >= 0]] for b, row in enumerate(ids)])
    return out, top[:, 0] + np.log(p.sum(1))


@pytest.mark.parametrize("k, beam", [(1, None), (10, 64), (100, None), (2000, None), (5000, None)],
                         ids=["k1", "k10-beam64", "k100", "k-all", "k-over"])
def test_attend_is_attention_over_what_search_retrieves(index, k, beam):
    idx, keys, values = index
    q = np.random.default_rng(4).standard_normal((7, 24)).astype(np.float32)
    kw = {} if beam is None else {"beam": beam}
    out, lse, scanned = idx.attend(q, values, k, 0.3, **kw)
    ids, want_scanned = idx.search(q, k=k, **kw)
    want_out, want_lse = _attention(q, keys, values, ids, 0.3)
    np.testing.assert_allclose(out, want_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
    assert scanned.tolist() == want_scanned.tolist()
    if k >= len(keys):                                  # every key: exact attention
        assert (scanned == len(keys)).all()


def test_attend_refuses_bad_values(index):
    idx, _, values = index
    q = np.zeros((1, 24), np.float32)
    with pytest.raises(ValueError, match="values"):
        idx.attend(q, values[:10], 5, 0.1)
    with pytest.raises(ValueError, match="values"):
        idx.attend(q, values.astype(np.float64), 5, 0.1)
    with pytest.raises(ValueError, match="beam"):
        idx.attend(q, values, 50, 0.1, beam=10)
    with pytest.raises(ValueError, match="queries"):
        idx.attend(np.zeros((1, 23), np.float32), values, 5, 0.1)


def test_an_index_set_splitting_query_heads_over_threads_answers_what_one_thread_does():
    """With fewer (row, KV head) pairs than threads, IndexSet searches a KV head's query heads in pieces on several
    threads (heads.IndexSet.attend); searched a head at a time (``group_search=False``) every query's answer is its own
    search, so the pieces change nothing (grouped, a piece's heads share a traversal: tests/index/test_group.py)."""
    from .helpers import random_heads

    keys, values, train, q = random_heads(5, hkv=2, n=900, d=16, m=300, b=1, hq=8)
    # 2 pairs, 7 threads: 4 query heads a KV head, one a piece
    one, many = IndexSet(threads=1, group_search=False), IndexSet(threads=7, group_search=False)
    try:
        for ix in (one, many):
            ix.add("seq", 0, keys, values, train)
        want, got = one.attend(0, ["seq"], q, 20, 0.3), many.attend(0, ["seq"], q, 20, 0.3)
        np.testing.assert_array_equal(got.out, want.out)
        np.testing.assert_array_equal(got.lse, want.lse)
        assert got.scanned.tolist() == want.scanned.tolist() and want.scanned[0] > 0
    finally:
        one.close()
        many.close()


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "pool"])
def test_held_keys_are_scanned_exactly_until_their_index_replaces_them(compiled):
    """``IndexSet.hold``: K/V held with no graph are scanned whole at every search, which finds each query's exact top
    keys (here: the codes' beam of 128 holds the top 100); ``add`` then replaces them with a built index, searched by
    its graph. A malformed hold is refused and changes nothing held."""
    from services.index import _layer

    from .helpers import exact_attention, random_heads

    hkv, n, d, hq = 2, 2000, 16, 4
    keys, values, train, q = random_heads(8, hkv, n, d, m=200, b=2, hq=hq)
    _layer.warm()
    ix = IndexSet(threads=2, compiled=compiled, scan_share=None)    # (no head scanned for reading widely)
    try:
        ix.hold("seq", 0, keys, values)
        ix.hold("other", 0, keys[:, :0], values[:, :0])             # nothing offloaded at this layer
        for _ in range(3):                                         # scanned at every call, not a few
            ans = ix.attend(0, ["seq", "seq"], q, k=100, scale=0.25)
            assert ans.scanned.tolist() == [hkv * n] * 2
        for b in range(2):
            for j in range(hq):
                head = j // (hq // hkv)
                top = np.argsort(-(keys[head].astype(np.float64) @ q[b, j].astype(np.float64)))[:100]
                out, lse = exact_attention(q[b, j:j + 1], keys[head], values[head], top[None], 0.25)
                np.testing.assert_allclose(ans.out[b, j], out[0], rtol=1e-4, atol=1e-5)
                np.testing.assert_allclose(ans.lse[b, j], lse[0], rtol=1e-5, atol=1e-5)
        assert ix.calls_by_path()["compiled" if compiled else "pool"] == 3
        with pytest.raises(ValueError, match="keys and values must both be"):
            ix.hold("seq", 0, keys, values[:, :10])
        assert ix.attend(0, ["seq"], q[:1], k=100, scale=0.25).scanned.tolist() == [hkv * n]    # still held
        codes = [h.index.compact for h in ix._heads[("seq", 0)]]
        assert all(np.shares_memory(h.keys, keys) for h in ix._heads[("seq", 0)])    # held as given, not copied
        ix.add("seq", 0, keys, values, train)
        assert all(h.index.compact is c for h, c in zip(ix._heads[("seq", 0)], codes))   # the codes hold made
        searched = ix.attend(0, ["seq"], q[:1], k=10, scale=0.25)
        assert 0 < searched.scanned[0] < hkv * n and not ix._scans  # the graph's search, no scan left
        assert ix.held()[0] == 2
    finally:
        ix.close()
