"""Searches on the int8 keys (services/index/compact.py): with a beam covering every key the compact traversal keeps
exactly the float32 traversal's top-k and its exact attention; what it returns is ranked by exact scores; quantising
constant, zero, huge or tiny keys gives finite codes and answers; the codes are the keys' own after a round trip."""

from __future__ import annotations

import numpy as np
import pytest

from services.index import AttentionIndex
from services.index._search import search_attend, search_batch
from services.index._search_group import search_attend_group, search_group_batch
from services.index.build import Graph
from services.index.compact import quantize, quantize_twin

from .helpers import exact_attention


def _normal(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _nav(index: AttentionIndex, compact: bool):
    """The compiled search's first arguments, as ``AttentionIndex`` passes them: (nav, step, keys) and exact_nav."""
    if compact:
        return (index.compact.codes, index.compact.step, index.keys), False
    return (index.keys, np.ones(index.dim, np.float32), index.keys), True


def _groups(index, q, k, beam, compact, values, scale):
    """The compiled grouped search and search-and-attend (no exact shortcut): ids, scanned, out, lse."""
    b, g, _ = q.shape
    nav, exact = _nav(index, compact)
    gr = index.graph
    ids, scores, scanned = np.empty((b, g, k), np.int64), np.empty((b, g, k), np.float32), np.empty(b, np.int64)
    search_group_batch(*nav, gr.offsets, gr.targets, gr.entries, q, beam, k, exact, ids, scores, scanned)
    out, lse = np.empty((b, g, values.shape[1]), np.float32), np.empty((b, g), np.float32)
    read = np.empty(b, np.int64)
    search_attend_group(*nav, gr.offsets, gr.targets, gr.entries, values, q, beam, k, exact, scale, out, lse, read)
    np.testing.assert_array_equal(read, scanned)
    return ids, scanned, out, lse


@pytest.mark.parametrize("n, d, g, k", [(600, 24, 1, 50), (600, 13, 3, 40), (400, 37, 4, 100), (300, 64, 4, 300),
                                        (9, 5, 3, 4)],
                         ids=["N600-D24-G1", "N600-D13-G3", "N400-D37-G4", "N300-D64-G4-k-all", "N9-D5-G3"])
def test_a_beam_covering_every_key_keeps_the_exact_top_k_and_attention(n, d, g, k):
    keys, values = _normal(0, (n, d)), _normal(1, (n, 7))
    index = AttentionIndex.build(keys, _normal(2, (2 * n, d)) + 0.3, threads=1)
    q = (np.random.default_rng(3).uniform(0.5, 3.0, (5, g, 1)) * _normal(4, (5, g, d))).astype(np.float32)
    want = np.argsort(-np.einsum("bgd,nd->bgn", q.astype(np.float64), keys.astype(np.float64)), axis=2)[:, :, :k]
    ids8, scanned8, out8, lse8 = _groups(index, q, k, n, True, values, 0.2)
    ids32, scanned32, out32, lse32 = _groups(index, q, k, n, False, values, 0.2)
    assert (scanned8 == n).all() and (scanned32 == n).all()
    np.testing.assert_array_equal(ids8, want)
    np.testing.assert_array_equal(ids8, ids32)
    np.testing.assert_allclose(out8, out32, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse8, lse32, rtol=1e-6, atol=1e-6)
    want_out, want_lse = exact_attention(q.reshape(5 * g, d), keys, values, want.reshape(5 * g, k), 0.2)
    np.testing.assert_allclose(out8.reshape(5 * g, -1), want_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse8.reshape(-1), want_lse, rtol=1e-5, atol=1e-5)
    # a query at a time: the same
    nav, exact = _nav(index, True)
    gr, flat = index.graph, np.ascontiguousarray(q.reshape(5 * g, d))
    ids, scores, scanned = np.empty((5 * g, k), np.int64), np.empty((5 * g, k), np.float32), np.empty(5 * g, np.int64)
    search_batch(*nav, gr.offsets, gr.targets, gr.entries, flat, n, k, exact, ids, scores, scanned)
    np.testing.assert_array_equal(ids, want.reshape(5 * g, k))
    out, lse = np.empty((5 * g, 7), np.float32), np.empty(5 * g, np.float32)
    search_attend(*nav, gr.offsets, gr.targets, gr.entries, values, flat, n, k, exact, 0.2, out, lse, scanned)
    np.testing.assert_allclose(out, want_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("g", [1, 3, 4], ids=["G1", "G3", "G4"])
def test_what_a_compact_search_returns_is_ranked_and_attended_by_exact_scores(g):
    """A narrow beam (it reads a part of the keys): each head's ids in descending exact score, and the attention the
    exact one over them."""
    keys, values = _normal(5, (1500, 20)), _normal(6, (1500, 9))
    index = AttentionIndex.build(keys, _normal(7, (2000, 20)) + 0.5, threads=1)
    q = _normal(8, (6, g, 20)) + 0.5
    ids, scanned = index.search_group(q, 30, beam=60)
    assert (scanned < 1500).all()
    exact = np.take_along_axis(np.einsum("bgd,nd->bgn", q, keys), ids, axis=2)
    assert (np.diff(exact, axis=2) <= 1e-5).all()
    out, lse, _ = index.attend_group(q, values, 30, 0.3, beam=60)
    want_out, want_lse = exact_attention(q.reshape(6 * g, -1), keys, values, ids.reshape(6 * g, -1), 0.3)
    np.testing.assert_allclose(out.reshape(6 * g, -1), want_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse.reshape(-1), want_lse, rtol=1e-5, atol=1e-5)
    one_ids, _ = index.search(q.reshape(6 * g, -1), 30, beam=60)
    one_exact = np.take_along_axis(q.reshape(6 * g, -1) @ keys.T, one_ids, axis=1)
    assert (np.diff(one_exact, axis=1) <= 1e-5).all()


def _complete(n: int) -> Graph:
    """Every key linked to every other: a graph any keys can take (a build over such keys would not be the point)."""
    targets = np.array([j for i in range(n) for j in range(n) if j != i], np.int32)
    return Graph(np.arange(0, n * (n - 1) + 1, n - 1, dtype=np.int64), targets, np.zeros(1, np.int64))


@pytest.mark.parametrize("kind", ["zero", "constant", "huge", "tiny", "one-dim-zero"])
def test_awkward_keys_quantise_to_finite_codes_and_answers(kind):
    base = _normal(9, (40, 11))
    keys = {"zero": np.zeros_like(base), "constant": np.full_like(base, 3.5), "huge": base * np.float32(1e30),
            "tiny": base * np.float32(1e-40), "one-dim-zero": base * (np.arange(11) != 4)}[kind].astype(np.float32)
    codes = quantize(keys)
    assert codes.codes.dtype == np.int8 and codes.step.dtype == np.float32
    assert np.isfinite(codes.step).all() and (codes.step >= 0).all()
    assert (np.abs(codes.codes.astype(np.float64) * codes.step - keys) <= 0.5 * codes.step + 1e-45 * 128).all()
    index = AttentionIndex.compose(keys, [_complete(40)])
    values = _normal(10, (40, 6))
    q = _normal(11, (3, 4, 11))
    ids, _ = index.search_group(q, 10, beam=20)
    want, _ = index.search_group(q, 10, beam=20, compact=False)
    assert ((ids >= 0) & (ids < 40)).all()
    out, lse, _ = index.attend_group(q, values, 10, 0.1, beam=20)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    if kind in ("huge", "one-dim-zero"):       # distinct scores: the exact top 10 whichever keys steered
        np.testing.assert_array_equal(ids, want)


def test_the_codes_are_the_keys_own_after_a_round_trip():
    keys = _normal(12, (300, 19))
    index = AttentionIndex.build(keys, _normal(13, (400, 19)), threads=1)
    again = AttentionIndex.from_bytes(index.to_bytes())
    np.testing.assert_array_equal(again.compact.codes, index.compact.codes)
    np.testing.assert_array_equal(again.compact.step, index.compact.step)
    assert index.nbytes == keys.nbytes + index.compact.nbytes + index.graph.offsets.nbytes + index.graph.targets.nbytes


@pytest.mark.parametrize("scale", [1e-42, 1e-30, 1e-3, 1.0, 1e30])
def test_quantize_is_its_numpy_twin_bit_for_bit(scale):
    keys = _normal(11, (777, 37)) * np.float32(scale)
    keys[:, 3] = 0.0                                  # a dimension zero in every key
    keys[:, 5] = keys[0, 5]                           # a constant one
    keys[:5, 7] = [127.0, 0.5, -0.5, 1.5, -127.0]     # ties of rint (half to even) once scaled by the step
    got = quantize(keys)
    codes, step = quantize_twin(keys)
    np.testing.assert_array_equal(got.codes, codes)
    np.testing.assert_array_equal(got.step, step)
    assert not got.codes.flags.writeable and not got.step.flags.writeable
