"""Retrieval decode over shared chunks' own indexes (services/engine/decode/retrieval.py, services/index/chunks.py):
a chunk wholly offloaded is searched through the graphs built once in its frame, which later requests reuse at other
offsets and which survive their bytes' round trip; damaged bytes are refused and the index is built again."""

from __future__ import annotations

import pytest
import torch

from services.engine import Engine
from services.engine.decode import DENSE, RetrievalDecode
from services.engine.options import EngineOptions

from ..conftest import random_request

SMALL = dict(sink_tokens=4, window_tokens=8)


def request(seed: int, shared: list[list[int]]):
    """A 16-token head chunk (the sink's page), the shared chunks, a 16-token tail chunk (the window's page)."""
    (head, tail), suffix = random_request(seed, lengths=(16, 16), suffix_len=2)
    return [head, *shared, tail], suffix


def built(eng) -> set:
    held = eng.forward.chunk_indexes
    return set() if held is None else set(held._items)


def test_wholly_offloaded_chunks_are_searched_through_their_own_graphs_built_once_and_reused(tiny_dir):
    eng = Engine.load(tiny_dir)
    (a, b), _ = random_request(60, lengths=(48, 64), suffix_len=1)
    ids = {eng.chunk_id(a), eng.chunk_id(b)}
    chunks, suffix = request(61, [a, b])
    dense = eng.generate(chunks, suffix, max_new_tokens=6, stop_token_ids=[], recompute_ratio=0.0)
    got = eng.generate(chunks, suffix, max_new_tokens=6, stop_token_ids=[], recompute_ratio=0.0,
                       decode="retrieval", retrieval_k=4096, **SMALL)
    assert got == dense                                  # every key retrieved: dense decoding
    assert built(eng) == ids                             # and the two shared chunks have their indexes
    first = {key: eng.forward.chunk_indexes.get(key) for key in ids}
    # another request places them elsewhere (b first, after a longer head): the same indexes, nothing rebuilt
    (head, tail), suffix2 = random_request(62, lengths=(40, 16), suffix_len=3)
    chunks2 = [head, b, a, tail]
    _, seq = eng.prefill_sequence(chunks2, suffix2, recompute_ratio=0.0, decode=RetrievalDecode(retrieval_k=8, **SMALL),
                                  extra_tokens=2)
    try:
        assert not eng.forward.chunk_builds or all(f.done() for f in eng.forward.chunk_builds.values())
        seq.offload.build.result()
        assert {key: eng.forward.chunk_indexes.get(key) for key in ids} == first
        index = eng.forward.indexes._heads[(seq.offload.owner, 0)][0].index
        # the composed index starts from every chunk's entries and one more part (the head chunk's rest)
        assert index.graph.entries.shape[0] > 2
        eng.decode_step([seq], [5])
        assert seq.decode_stats.keys_scanned > 0
    finally:
        eng.release(seq)


def test_a_chunk_placed_twice_in_one_request_is_searched_through_one_index_at_both_offsets(tiny_dir):
    eng = Engine.load(tiny_dir)
    (a, b), _ = random_request(63, lengths=(48, 32), suffix_len=1)
    chunks, suffix = request(64, [a, b, a])
    dense = eng.generate(chunks, suffix, max_new_tokens=6, stop_token_ids=[], recompute_ratio=0.0)
    got = eng.generate(chunks, suffix, max_new_tokens=6, stop_token_ids=[], recompute_ratio=0.0,
                       decode="retrieval", retrieval_k=4096, **SMALL)
    assert got == dense
    assert built(eng) == {eng.chunk_id(a), eng.chunk_id(b)}


def test_recomputed_tokens_are_searched_with_their_own_keys_and_every_key_retrieved_is_dense(tiny_dir):
    """CacheBlend recomputes some of a chunk's tokens: the chunk's graph is composed over the request's keys, the
    recomputed ones included, so retrieving every key is still exactly dense decoding (logits within fp32)."""
    eng = Engine.load(tiny_dir)
    (a, b, c), _ = random_request(63, lengths=(64, 64, 64), suffix_len=1)
    chunks, suffix = request(64, [a, b, c])
    out = []
    for policy in (DENSE, RetrievalDecode(retrieval_k=10_000, **SMALL)):
        logits, seq = eng.prefill_sequence(chunks, suffix, recompute_ratio=0.3, decode=policy, extra_tokens=3)
        out.append(torch.stack([logits] + [eng.decode_step([seq], [t])[0] for t in (4, 8, 15)]))
        eng.release(seq)
    torch.testing.assert_close(out[1], out[0], rtol=1e-5, atol=1e-5)
    assert built(eng)                                    # at least the middle chunk was wholly offloaded


def test_chunk_indexes_round_trip_through_their_bytes_and_damaged_bytes_are_refused_then_rebuilt(tiny_dir):
    a_eng, b_eng = Engine.load(tiny_dir), Engine.load(tiny_dir)
    (a,), _ = random_request(65, lengths=(64,), suffix_len=1)
    chunks, suffix = request(66, [a])
    cid = a_eng.chunk_id(a)
    assert a_eng.export_chunk_index(cid) is None
    a_eng.generate(chunks, suffix, max_new_tokens=2, recompute_ratio=0.0, decode="retrieval", retrieval_k=8, **SMALL)
    blob = a_eng.export_chunk_index(cid)
    assert blob is not None
    # a good copy is kept by another engine and used there without a build
    b_eng.insert_chunk_index(cid, blob)
    b_eng.generate(chunks, suffix, max_new_tokens=2, recompute_ratio=0.0, decode="retrieval", retrieval_k=8, **SMALL)
    assert b_eng.export_chunk_index(cid) == blob
    # a damaged copy is refused, nothing is kept, and the next retrieval decode builds the index again
    c_eng = Engine.load(tiny_dir)
    bad = bytearray(blob)
    bad[len(bad) // 3] ^= 0x04
    with pytest.raises(ValueError, match="digest"):
        c_eng.insert_chunk_index(cid, bytes(bad))
    assert c_eng.export_chunk_index(cid) is None
    c_eng.generate(chunks, suffix, max_new_tokens=2, recompute_ratio=0.0, decode="retrieval", retrieval_k=8, **SMALL)
    assert c_eng.export_chunk_index(cid) == blob         # built again, the same graphs (builds are deterministic)


def test_with_chunk_indexes_off_every_sequence_builds_its_own(tiny_dir):
    eng = Engine.load(tiny_dir, options=EngineOptions(chunk_indexes=False))
    (a,), _ = random_request(67, lengths=(64,), suffix_len=1)
    chunks, suffix = request(68, [a])
    eng.generate(chunks, suffix, max_new_tokens=3, recompute_ratio=0.0, decode="retrieval", retrieval_k=8, **SMALL)
    assert built(eng) == set()


def test_chunk_indexes_are_kept_in_the_store_and_a_damaged_copy_there_is_refused_and_replaced(tiny_dir, tmp_path,
                                                                                               monkeypatch):
    """A decode worker's engine stores each chunk index it builds (services/cluster/kvio.py ChunkIndexStore); another
    engine on the same store loads it instead of building; a damaged stored copy is refused, built again and
    replaced."""
    from services.cluster.kvio import ChunkIndexStore, StoreAccess
    from services.engine.kv.chunk_ids import index_entry_id
    from services.index import chunks as chunk_module
    from services.kvstore import BackgroundServer, StoreConfig

    (a,), _ = random_request(69, lengths=(64,), suffix_len=1)
    chunks, suffix = request(70, [a])
    with BackgroundServer(StoreConfig(dram_bytes=16 << 20, rocksdb_dir=str(tmp_path / "rocksdb"))) as srv:
        store = StoreAccess([srv.address])
        engines = [Engine.load(tiny_dir) for _ in range(3)]
        for eng in engines:
            eng.forward.chunk_index_store = ChunkIndexStore(store)

        def run(eng):
            return eng.generate(chunks, suffix, max_new_tokens=4, stop_token_ids=[], recompute_ratio=0.0,
                                decode="retrieval", retrieval_k=8, **SMALL)

        first = run(engines[0])
        cid = engines[0].chunk_id(a)
        blob = engines[0].export_chunk_index(cid)
        store._puts.submit(lambda: None).result()            # the put thread has stored it
        assert store.get_blob(index_entry_id(cid)) == blob
        built = chunk_module.ChunkIndex.build
        monkeypatch.setattr(chunk_module.ChunkIndex, "build", classmethod(
            lambda *_a, **_k: (_ for _ in ()).throw(AssertionError("built, not loaded"))))
        assert run(engines[1]) == first                       # loaded from the store: no build
        assert engines[1].export_chunk_index(cid) == blob
        monkeypatch.setattr(chunk_module.ChunkIndex, "build", built)
        bad = bytearray(blob)
        bad[100] ^= 1
        client = store._client.client_for(index_entry_id(cid))
        client.delete(index_entry_id(cid))
        client.put_bytes(index_entry_id(cid), bytes(bad))    # a writer's bad bytes (the store checks only transport)
        assert run(engines[2]) == first                       # refused, built again
        assert engines[2].forward.chunk_index_refused == 1
        assert engines[2].export_chunk_index(cid) == blob
        store._puts.submit(lambda: None).result()
        assert store.get_blob(index_entry_id(cid)) == blob    # and the store's copy replaced
        store.close()


@pytest.mark.parametrize("where", ["query pass", "build"])
def test_a_chunk_index_that_cannot_be_had_falls_back_to_the_sequences_own_index(tiny_dir, monkeypatch, where):
    """The chunk's query pass (no KV blocks left for it) or its build fails: the sequence indexes every key itself,
    decodes as dense when every key is retrieved, and no chunk index is kept."""
    from services.engine.kv.chunk_cache import PoolExhausted
    from services.engine.passes.forward import Forward
    from services.index.chunks import ChunkIndex

    def fail(*_a, **_k):
        raise PoolExhausted("KV memory exhausted (test)") if where == "query pass" else RuntimeError("build (test)")

    monkeypatch.setattr(Forward, "tap_chunk", fail) if where == "query pass" else \
        monkeypatch.setattr(ChunkIndex, "build", classmethod(fail))
    eng = Engine.load(tiny_dir)
    (a, b), _ = random_request(71, lengths=(48, 64), suffix_len=1)
    chunks, suffix = request(72, [a, b])
    dense = eng.generate(chunks, suffix, max_new_tokens=5, stop_token_ids=[], recompute_ratio=0.0)
    got = eng.generate(chunks, suffix, max_new_tokens=5, stop_token_ids=[], recompute_ratio=0.0,
                       decode="retrieval", retrieval_k=4096, **SMALL)
    assert got == dense and built(eng) == set()


def test_a_decode_workers_preparation_fetches_the_stored_chunk_indexes_off_the_engine_thread(tiny_dir, tmp_path):
    """prepare (the decode worker's helper thread) fetches the stored indexes of a retrieval request's shared chunks
    that the engine lacks; the engine thread adopts them without a store call of its own; damaged bytes are refused,
    counted, and the store's copy dropped."""
    from services.cluster.kvio import ChunkIndexStore, StoreAccess
    from services.engine.kv.chunk_ids import index_entry_id
    from services.handoff.prepare import prepare
    from services.handoff.transport import ReceivedHandoff
    from services.kvstore import BackgroundServer, StoreConfig
    from services.rpc import tessera_pb2 as pb

    (a,), _ = random_request(71, lengths=(64,), suffix_len=1)
    chunks, suffix = request(72, [a])
    with BackgroundServer(StoreConfig(dram_bytes=16 << 20)) as srv:
        store = StoreAccess([srv.address])
        first, second = Engine.load(tiny_dir), Engine.load(tiny_dir)
        first.forward.chunk_index_store = ChunkIndexStore(store)
        first.generate(chunks, suffix, max_new_tokens=2, stop_token_ids=[], recompute_ratio=0.0,
                       decode="retrieval", retrieval_k=8, **SMALL)
        cid = first.chunk_id(a)
        blob = first.export_chunk_index(cid)
        store._puts.submit(lambda: None).result()            # the put thread has stored it
        _, handoff = first.prefill_handoff(chunks, suffix, recompute_ratio=0.0)
        received = ReceivedHandoff(pb.HandoffHeader(request_id="r", kind="engine"), handoff.to_bytes())

        calls = []

        class Counting(ChunkIndexStore):
            def get(self, chunk_id):
                calls.append(chunk_id)
                return super().get(chunk_id)

        prepared = prepare(received, second, store, index_store=Counting(store))
        assert prepared.chunk_indexes == {cid: (blob, len(a))} and cid in calls
        assert not second.holds_chunk_index(cid)
        assert second.adopt_chunk_index(cid, *prepared.chunk_indexes[cid])      # the engine thread's part
        assert second.holds_chunk_index(cid) and second.export_chunk_index(cid) == blob
        calls.clear()
        assert prepare(received, second, store, index_store=Counting(store)).chunk_indexes == {}
        assert cid not in calls                               # held already: not fetched again

        bad = bytearray(blob)
        bad[100] ^= 1
        third = Engine.load(tiny_dir)
        third.forward.chunk_index_store = ChunkIndexStore(store)
        assert not third.adopt_chunk_index(cid, bytes(bad), len(a))
        assert third.forward.chunk_index_refused == 1 and not third.holds_chunk_index(cid)
        store._puts.submit(lambda: None).result()
        assert store.get_blob(index_entry_id(cid)) is None    # the store's copy dropped, to be replaced
        store.close()
