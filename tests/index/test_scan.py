"""A whole scan instead of the graph (services/index/_scan.py, ``AttentionIndex.attend_group(scan=True)``): each
head's exact top-k keys attended exactly; ``IndexSet`` scans a head whose graph searches read at least ``scan_share`` of its keys, for
``SCAN_CALLS`` searches, then asks its graph again; never with ``scan_share=None``; a dropped owner leaves no state."""

from __future__ import annotations

import numpy as np
import pytest

from services.index import AttentionIndex
from services.index import heads as heads_mod
from services.index.heads import IndexSet

from .helpers import exact_attention


def _normal(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.fixture(scope="module")
def random_index():
    """1,500 keys of dim 48 with no structure for a graph to use, their values, and the index built on them."""
    keys, values = _normal(0, (1500, 48)), _normal(1, (1500, 40))
    return AttentionIndex.build(keys, _normal(2, (600, 48)), threads=1), keys, values


@pytest.mark.parametrize("g, k, beam", [(1, 1, None), (4, 20, 64), (3, 100, None), (5, 7, 32)])
def test_a_scan_attends_each_heads_exact_top_k(random_index, g, k, beam):
    index, keys, values = random_index
    q = (1.5 * _normal(3 + g, (2, g, 48))).astype(np.float32)
    out, lse, scanned = index.attend_group(q, values, k, 0.2, beam=beam, scan=True)
    assert out.shape == (2, g, 40) and lse.shape == (2, g) and scanned.tolist() == [1500, 1500]
    flat = q.reshape(-1, 48)
    top = np.argsort(-(flat @ keys.T), axis=1, kind="stable")[:, :k]          # the exact top-k of every head
    want, want_lse = exact_attention(flat, keys, values, top, 0.2)
    np.testing.assert_allclose(out.reshape(-1, 40), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse.reshape(-1), want_lse, rtol=1e-5, atol=1e-5)


def test_a_scans_inputs_are_checked_as_a_graph_searchs_are(random_index):
    index, _, values = random_index
    with pytest.raises(ValueError, match="queries"):
        index.attend_group(np.zeros((2, 48), np.float32), values, 5, 0.2, scan=True)
    with pytest.raises(ValueError, match="values"):
        index.attend_group(np.zeros((1, 2, 48), np.float32), values[:10], 5, 0.2, scan=True)
    with pytest.raises(ValueError, match="beam"):
        index.attend_group(np.zeros((1, 2, 48), np.float32), values, 5, 0.2, beam=3, scan=True)


def test_an_index_set_scans_a_head_its_graph_searches_read_widely_and_asks_the_graph_again(monkeypatch):
    monkeypatch.setattr(heads_mod, "SCAN_CALLS", 2)
    hkv, n, d, hq = 2, 1200, 32, 4
    keys, values = _normal(10, (hkv, n, d)), _normal(11, (hkv, n, d))
    train = _normal(12, (hkv, 300, d))
    q = _normal(13, (1, hq, d))
    scanning, graph_only = IndexSet(threads=1), IndexSet(threads=1, scan_share=None)
    try:
        for ix in (scanning, graph_only):
            ix.add("a", 0, keys, values, train)
            ix.add("a", 1, keys, values, train)
        first = scanning.attend(0, ["a"], q, 10, 0.3)
        assert 0.3 * hkv * n <= first.scanned[0] < hkv * n      # random keys: the graphs read widely, not all
        reads = [scanning.attend(0, ["a"], q, 10, 0.3).scanned[0] for _ in range(3)]
        assert reads[:2] == [hkv * n, hkv * n] and reads[2] == first.scanned[0]   # scanned twice, then the graph
        assert scanning.attend(1, ["a"], q, 10, 0.3).scanned[0] == first.scanned[0]   # layer 1: its own record
        flat = q[0].reshape(hkv, hq // hkv, d)
        scanned = scanning.attend(0, ["a"], q, 10, 0.3)
        for h in range(hkv):
            top = np.argsort(-(flat[h] @ keys[h].T), axis=1, kind="stable")[:, :10]
            want, want_lse = exact_attention(flat[h], keys[h], values[h], top, 0.3)
            np.testing.assert_allclose(scanned.out[0, h * 2:(h + 1) * 2], want, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(scanned.lse[0, h * 2:(h + 1) * 2], want_lse, rtol=1e-5, atol=1e-5)
        assert all(graph_only.attend(0, ["a"], q, 10, 0.3).scanned[0] == first.scanned[0] for _ in range(3))
        scanning.drop("a")
        assert not scanning._scans                                 # noqa: SLF001 - no state outlives its owner
    finally:
        scanning.close()
        graph_only.close()
    with pytest.raises(ValueError, match="scan_share"):
        IndexSet(scan_share=0.0)
