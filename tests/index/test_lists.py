"""Exact lists computed elsewhere (the GPU that holds the keys: services/engine/decode/retrieval.py ``exact_lists``)
and handed to the index (``AttentionIndex.build(lists=)``, ``repaired(lists=)``, ``IndexSet.add(lists=)``, the
service's ``Offload``): the graph is the one the build makes with its own faiss lists, edge for edge; the engine's
torch ranking gives faiss' lists (the same keys, in the same order but for ties); lists that do not fit (shape,
dtype, a key out of range) are refused by name, and a refused call stores nothing."""

from __future__ import annotations

import zlib

import grpc
import numpy as np
import pytest
import torch

from services.engine.decode.retrieval import exact_lists as ranked_on_device
from services.index import _layer
from services.index.build import BuildConfig, exact_lists
from services.index.chunks import ChunkIndex
from services.index.client import IndexClient
from services.index.graph import AttentionIndex
from services.index.heads import COMPOSED, IndexSet
from services.index.server import BackgroundIndexServer
from services.rpc import index_pb2 as pb


def _normal(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _same_graph(a: AttentionIndex, b: AttentionIndex) -> None:
    for x, y in ((a.graph.offsets, b.graph.offsets), (a.graph.targets, b.graph.targets),
                 (a.graph.entries, b.graph.entries)):
        np.testing.assert_array_equal(x, y)


def test_the_engines_ranking_is_faiss_lists():
    keys, queries = _normal(1, (3, 700, 24)), _normal(2, (3, 50, 24))
    got = ranked_on_device(torch.from_numpy(keys), torch.from_numpy(queries))
    assert got.dtype == np.int32 and got.shape == (3, 50, BuildConfig().query_neighbors)
    for h in range(3):
        want = exact_lists(keys[h], queries[h], got.shape[2], 1)
        assert (got[h] == want).mean() > 0.99                        # ties aside, the same order
        assert all(set(g) == set(w) for g, w in zip(got[h], want))
    # fewer keys than the lists' length: every key, best first; a bfloat16 layer ranks as its float32 widening
    small = ranked_on_device(torch.from_numpy(keys[:, :30]).bfloat16(), torch.from_numpy(queries))
    assert small.shape == (3, 50, 30)
    np.testing.assert_array_equal(small, ranked_on_device(torch.from_numpy(keys[:, :30]).bfloat16().float(),
                                                          torch.from_numpy(queries)))


def test_given_lists_build_and_repair_the_graph_the_index_makes_itself():
    keys, train = _normal(3, (900, 16)), _normal(4, (120, 16))
    lists = exact_lists(keys, train, 100, 1)
    _same_graph(AttentionIndex.build(keys, train, lists=lists), AttentionIndex.build(keys, train))
    # a composition of two chunk graphs, repaired with the request's queries (more of them than the lists need)
    parts = [AttentionIndex.build(keys[:450], train).graph, AttentionIndex.build(keys[450:], train).graph]
    composed = AttentionIndex.compose(keys, parts, COMPOSED)
    wide = np.concatenate([lists, np.zeros((120, 8), np.int64)], axis=1)          # columns past P are not read
    _same_graph(composed.repaired(train, lists=wide), composed.repaired(train))


@pytest.mark.parametrize("bad, message", [
    (np.zeros((119, 100), np.int64), r"integer \[120, >= 100\]"),
    (np.zeros((120, 99), np.int64), r"integer \[120, >= 100\]"),
    (np.zeros((120, 100), np.float32), r"integer \[120, >= 100\]"),
    (np.full((120, 100), 900, np.int64), r"outside 0..899"),
    (np.full((120, 100), -1, np.int64), r"outside 0..899"),
])
def test_lists_that_do_not_fit_are_refused_by_name(bad, message):
    keys, train = _normal(3, (900, 16)), _normal(4, (120, 16))
    with pytest.raises(ValueError, match=message):
        AttentionIndex.build(keys, train, lists=bad)
    with pytest.raises(ValueError, match=message):
        AttentionIndex.compose(keys, [AttentionIndex.build(keys, train).graph]).repaired(train, lists=bad)


def test_an_index_set_given_lists_answers_as_without_and_refuses_bad_ones_keeping_nothing():
    hkv, d = 2, 16
    keys, values, train = _normal(5, (hkv, 600, d)), _normal(6, (hkv, 600, d)), _normal(7, (hkv, 90, d))
    chunk = ChunkIndex.build([keys[:, :300]], [train])
    lists = np.stack([exact_lists(keys[h], train[h], 100, 1) for h in range(hkv)])
    given, own = IndexSet(threads=2), IndexSet(threads=2)
    try:
        for ix, arg in ((given, lists), (own, None)):
            ix.add("whole", 0, keys, values, train, lists=arg)
            ix.add("composed", 0, keys, values, train, [("c", chunk)], lists=arg)
        q = _normal(8, (2, 4, d))
        for owner in ("whole", "composed"):
            a, b = given.attend(0, [owner, owner], q, 10, 0.3), own.attend(0, [owner, owner], q, 10, 0.3)
            np.testing.assert_array_equal(a.out, b.out)
            np.testing.assert_array_equal(a.scanned, b.scanned)
        before = given.held()
        for bad in (lists[:1], lists[:, :, :50], lists + 600):
            with pytest.raises(ValueError, match="lists"):
                given.add("bad", 0, keys, values, train, lists=bad)
        assert given.held() == before and "bad" not in given
    finally:
        given.close()
        own.close()


def test_lists_over_the_wire_answer_as_in_process_and_bad_ones_are_refused():
    hkv, n, d, m = 2, 400, 16, 60
    keys, values, train = _normal(9, (hkv, n, d)), _normal(10, (hkv, n, d)), _normal(11, (hkv, m, d))
    lists = np.stack([exact_lists(keys[h], train[h], 100, 1) for h in range(hkv)]).astype(np.int32)
    _layer.warm()               # compiled first: a compile in the service's background holds the GIL past deadlines
    local = IndexSet(threads=2)          # as the service's: how a call is cut in pieces follows the threads
    # NOTE: deadlines of minutes: on a clean machine the first calls compile numba loops, the GIL held, while the
    # other test worker takes the second core (CI saw 30 s pass)
    with BackgroundIndexServer(threads=2) as srv, IndexClient(srv.address, timeout=300) as client:
        local.add("s", 0, keys, values, train, lists=lists)
        client.add("s", 0, keys, values, train, lists=lists)
        q = _normal(12, (1, 4, d))
        want = local.attend(0, ["s"], q, 10, 0.3)       # in process first: what it compiles, the service finds
        got = client.attend(0, ["s"], q, 10, 0.3)
        # (the same keys found; attended on the compiled call or the pool, whichever is ready: float rounding apart)
        assert got.scanned.tolist() == want.scanned.tolist()
        np.testing.assert_allclose(got.out, want.out, rtol=1e-6, atol=1e-6)
        before = client.held()
        body = keys.tobytes() + values.tobytes() + train.tobytes()
        good = dict(owner="t", layer=0, kv_shape=[hkv, n, d], train_shape=[hkv, m, d])
        out_of_range = lists.copy()
        out_of_range[1, 2, 3] = n
        for shape, extra in (([hkv, m + 1, 100], lists), ([hkv, m, 2000], lists), ([hkv, m], lists),
                             ([hkv, m, 50], lists[:, :, :50]), ([hkv, m, 100], out_of_range)):
            data = body + np.ascontiguousarray(extra, "<i4").tobytes()
            header = pb.OffloadHeader(**good, crc32=zlib.crc32(data), lists_shape=shape)

            def send():
                def parts():
                    yield pb.OffloadPart(header=header)
                    yield pb.OffloadPart(data=data)
                return client._stub.Offload(parts(), timeout=10)

            with pytest.raises(grpc.RpcError) as err:
                send()
            assert err.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DATA_LOSS), shape
            assert "lists" in err.value.details() or err.value.code() == grpc.StatusCode.DATA_LOSS
        assert client.held() == before
    local.close()
