"""Chunk indexes (services/index/chunks.py): built once in a chunk's frame, composed over keys at any offset and found
the same keys there; their bytes round-trip, through the KV store too, and any damage is refused."""

from __future__ import annotations

import numpy as np
import pytest

from services.index import AttentionIndex, IndexFormatError
from services.index.chunks import ChunkIndex, ChunkIndexCache

D = 32
INV_FREQ = 1.0 / (10000.0 ** (np.arange(0, D, 2) / D))


def rope(x: np.ndarray, pos) -> np.ndarray:
    """Rotate-half RoPE of rows x [N, D] at positions pos (scalar or [N]), in float64, as float32."""
    ang = np.asarray(pos, np.float64).reshape(-1, 1) * INV_FREQ
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2 = x[:, : D // 2].astype(np.float64), x[:, D // 2:].astype(np.float64)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], 1).astype(np.float32)


def chunk(seed: int, length: int, layers: int = 1, heads: int = 1):
    """A chunk's keys at local positions and queries shifted forward: (keys [L][H, N, D], train [L][H, M, D])."""
    rng = np.random.default_rng(seed)
    keys, train = [], []
    for _ in range(layers):
        raw = rng.standard_normal((heads, length, D)).astype(np.float32)
        q = rng.standard_normal((heads, 3 * length, D)).astype(np.float32) + 0.5
        keys.append(np.stack([rope(raw[h], np.arange(length)) for h in range(heads)]))
        shifts = np.arange(3 * length) % length + np.array([0, 64, 512])[np.arange(3 * length) % 3]
        train.append(np.stack([rope(q[h], shifts) for h in range(heads)]))
    return keys, train


def test_a_chunk_index_built_once_finds_the_same_keys_for_a_query_at_two_offsets_of_the_chunk():
    keys, train = chunk(0, 301)
    ci = ChunkIndex.build(keys, train, threads=2)
    local = keys[0][0]
    rng = np.random.default_rng(1)
    queries = rng.standard_normal((24, D)).astype(np.float32) + 0.5
    found = []
    for offset in (37, 9000):
        placed = rope(local, offset)            # every key rotated by the offset: the chunk placed there
        index = AttentionIndex.compose(placed, [ci.graphs[0][0]])
        q = rope(queries, offset + 301 + 50)       # a decode query 50 positions past the chunk's end
        ids, scanned = index.search(q, k=10, beam=32)
        assert (scanned < 301).all()              # the graph searched, not every key scored
        found.append([set(r) for r in ids.tolist()])
    assert found[0] == found[1]
    # and they are the chunk's own answer in its frame, the query rotated back by the offset
    in_frame = AttentionIndex.compose(local, [ci.graphs[0][0]]).search(rope(queries, 301 + 50), k=10, beam=32)[0]
    assert [set(r) for r in in_frame.tolist()] == found[0]


def test_composed_chunks_and_a_graph_built_for_the_rest_search_all_keys_and_the_request_queries_repair_it():
    """Two chunks' graphs and one built over the keys after them: exact with k covering every key; the request's own
    queries link the parts (``repaired``), and its searches then find the true top keys across them."""
    parts, keys = [], []
    for seed, n in ((2, 200), (3, 150)):
        k, t = chunk(seed, n)
        parts.append(ChunkIndex.build(k, t, threads=1).graphs[0][0])
        keys.append(k[0][0])
    rng = np.random.default_rng(4)
    rest = rng.standard_normal((90, D)).astype(np.float32)
    request_queries = rng.standard_normal((600, D)).astype(np.float32) + 0.5
    rest_graph = AttentionIndex.build(rest, request_queries, threads=1).graph
    all_keys = np.concatenate(keys + [rest])
    index = AttentionIndex.compose(all_keys, parts + [rest_graph])
    assert index.graph.entries.shape[0] == 200 // 64 + 150 // 64 + 1     # one a 64 keys of a chunk, one of the rest
    q = rng.standard_normal((32, D)).astype(np.float32) + 0.5            # held out of every build
    exact = np.argsort(-(q @ all_keys.T), axis=1)[:, :20]
    ids, _ = index.search(q, k=all_keys.shape[0])
    np.testing.assert_array_equal(ids[:, :20], exact)

    def recall(idx):
        ids, scanned = idx.search(q, k=20, beam=64)
        assert (scanned < all_keys.shape[0]).all()
        return np.mean([len(set(a) & set(b)) / 20 for a, b in zip(ids.tolist(), exact.tolist())])

    repaired = index.repaired(request_queries, threads=1)
    assert repaired.graph.targets.shape[0] > index.graph.targets.shape[0]
    np.testing.assert_array_equal(repaired.graph.entries, index.graph.entries)
    assert recall(repaired) >= max(0.9, recall(index))
    with pytest.raises(ValueError, match="cover"):
        AttentionIndex.compose(all_keys[:-1], parts + [rest_graph])


def test_chunk_index_bytes_round_trip_and_any_damage_is_refused():
    keys, train = chunk(5, 97, layers=2, heads=3)
    ci = ChunkIndex.build(keys, train, threads=2)
    blob = ci.to_bytes()
    back = ChunkIndex.from_bytes(blob)
    assert (back.length, back.num_layers, back.num_heads, back.config) == (97, 2, 3, ci.config)
    for a, b in zip([g for gs in ci.graphs for g in gs], [g for gs in back.graphs for g in gs]):
        np.testing.assert_array_equal(a.offsets, b.offsets)
        np.testing.assert_array_equal(a.targets, b.targets)
        np.testing.assert_array_equal(a.entries, b.entries)
    rng = np.random.default_rng(6)
    for at in rng.choice(len(blob), 12, replace=False).tolist() + [0, len(blob) - 1]:
        bad = bytearray(blob)
        bad[at] ^= 0x10
        with pytest.raises(IndexFormatError):
            ChunkIndex.from_bytes(bytes(bad))
    for bad in (blob[:-1], blob + b"\0", b"", "not bytes"):
        with pytest.raises(IndexFormatError):
            ChunkIndex.from_bytes(bad)


def test_the_cache_keeps_the_most_recent_indexes_within_its_bytes():
    built = [ChunkIndex.build(*chunk(10 + i, 64), threads=1) for i in range(3)]
    cache = ChunkIndexCache(sum(b.nbytes for b in built) - 1)     # all three do not fit: one goes
    cache.put("a", built[0])
    cache.put("b", built[1])
    assert cache.get("a") is built[0]          # a is now the most recent
    cache.put("c", built[2])
    assert "b" not in cache and cache.get("a") is built[0] and cache.get("c") is built[2]
    assert cache.held()[1] <= cache.max_bytes


def test_a_chunk_index_survives_a_store_round_trip_and_a_damaged_copy_is_refused(tmp_path):
    from services.engine.kv.chunk_ids import index_entry_id
    from services.kvstore import BackgroundServer, KVStoreClient, StoreConfig

    ci = ChunkIndex.build(*chunk(7, 120, layers=2, heads=2), threads=2)
    blob = ci.to_bytes()
    entry = index_entry_id("a" * 64)
    assert entry != "a" * 64
    with BackgroundServer(StoreConfig(dram_bytes=8 << 20, rocksdb_dir=str(tmp_path / "rocksdb"))) as srv:
        with KVStoreClient(srv.address) as client:
            client.put_bytes(entry, blob)
            assert client.get_bytes(entry) == blob
            back = ChunkIndex.from_bytes(client.get_bytes(entry))
            np.testing.assert_array_equal(back.graphs[1][1].targets, ci.graphs[1][1].targets)
            bad = bytearray(blob)
            bad[len(bad) // 2] ^= 1          # damaged before it was stored: the store keeps it, the index refuses it
            client.put_bytes(index_entry_id("b" * 64), bytes(bad))
            with pytest.raises(IndexFormatError, match="digest"):
                ChunkIndex.from_bytes(client.get_bytes(index_entry_id("b" * 64)))


def test_an_index_set_repairs_a_composition_with_its_repair_queries(monkeypatch):
    """IndexSet(repair_queries=N): a composition of chunk graphs is repaired, in one round, from at most N of the
    request's queries (build.repair_graph samples them); a bad N is refused by name."""
    from services.index import build
    from services.index.heads import IndexSet

    k, t = chunk(5, 200, heads=1)
    ci = ChunkIndex.build(k, t, threads=1)
    train = np.random.default_rng(6).standard_normal((1, 600, D)).astype(np.float32) + 0.5
    keys = k[0]
    values = np.random.default_rng(7).standard_normal(keys.shape).astype(np.float32)
    searched = []
    real = build._repair
    monkeypatch.setattr(build, "_repair", lambda *a, **kw: searched.append((a[8].repair_queries, [len(p) for p in a[7]]))
                        or real(*a, **kw))
    for n in (None, 40):
        ix = IndexSet(threads=1, repair_queries=n)
        try:
            ix.add("seq", 0, keys, values, train, [("chunk", ci)])
            index = ix._heads[("seq", 0)][0].index
            assert index.config.repair_queries == (20000 if n is None else 40) and index.config.repair_rounds == 1
        finally:
            ix.close()
    assert searched == [(20000, [600]), (40, [40])]      # one round, of every query or of 40
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="repair_queries"):
            IndexSet(threads=1, repair_queries=bad)


def test_each_graph_searches_its_exact_lists_on_its_own_one_thread(monkeypatch):
    """A chunk's graphs build one a thread, so each one's exact kNN (faiss) must run on one OpenMP thread: an OpenMP
    count set in the calling thread would leave the build threads at every core each."""
    import faiss

    seen = []
    search = faiss.IndexFlatIP.search

    def spy(self, *args, **kwargs):
        seen.append(faiss.omp_get_max_threads())
        return search(self, *args, **kwargs)

    monkeypatch.setattr(faiss.IndexFlatIP, "search", spy)
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(2)              # the host's default, as the build threads see it
    try:
        rng = np.random.default_rng(0)
        keys = [rng.standard_normal((2, 40, 16), dtype=np.float32) for _ in range(2)]
        train = [rng.standard_normal((2, 24, 16), dtype=np.float32) for _ in range(2)]
        ChunkIndex.build(keys, train, threads=2)
    finally:
        faiss.omp_set_num_threads(before)
    assert len(seen) >= 4 and set(seen) == {1}       # a search or more a graph, every one on one thread
