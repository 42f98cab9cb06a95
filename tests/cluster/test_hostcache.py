"""The workers' host-memory chunk tier: budget and order, lookups before the shards, loads that equal computes."""

from __future__ import annotations

import pytest
import torch

from services.cluster.hostcache import HostChunks
from services.cluster.kvio import StoreAccess
from services.rpc import tessera_pb2 as pb
from services.tiers import Tier
from services.engine.kv.loader import StreamedLayer

from tests.helpers import docs


def layers(n_layers: int, tokens: int, fill: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((tokens, 2, 4), fill + i), torch.full((tokens, 2, 4), -fill - i)) for i in range(n_layers)]


def test_host_chunks_keep_the_most_recent_within_the_budget():
    one = 2 * 2 * 3 * 2 * 4 * 4          # 2 layers x (k, v) x 3 tokens x 2 heads x 4 dims x 4 bytes
    host = HostChunks(2 * one)
    assert host.put("a", layers(2, 3, 1.0)) and host.put("b", layers(2, 3, 2.0))
    assert host.get("a") is not None                 # a is now the most recent
    assert host.put("c", layers(2, 3, 3.0))          # evicts b, the least recent
    assert "b" not in host and "a" in host and "c" in host
    assert host.used == 2 * one and host.evictions == 1
    entry = host.get("c")
    got = list(entry.stream())
    assert [item.layer for item in got] == [0, 1] and torch.equal(got[1].k, torch.full((3, 2, 4), 4.0))
    assert not host.put("huge", layers(8, 3, 0.0))  # larger than the whole budget: refused, nothing evicted
    assert len(host) == 2
    assert host.get("b") is None and host.misses == 1
    assert host.clear() == 2 and host.used == 0
    with pytest.raises(ValueError, match=">= 0"):
        HostChunks(-1)


def test_store_access_serves_the_host_tier_without_any_shard():
    store = StoreAccess([], host_bytes=1 << 20)
    assert store.enabled
    kv = layers(3, 5, 1.0)
    assert store.put_later("x", kv) is False          # kept here, but no store write was queued
    assert store.lookup(["x", "y"]) == {"x": Tier.HOST}
    assert store.lookup(["x"], host=False) == {}
    stream = store.fetcher({"x": Tier.HOST})("x")
    got = list(stream)
    assert [i for i, _, _ in got] == [0, 1, 2]
    assert all(torch.equal(k, kv[i][0]) and torch.equal(v, kv[i][1]) for i, k, v in got)
    assert store.fetcher({"x": Tier.HOST})("y") is None
    store.drop_known()
    assert store.lookup(["x"]) == {}
    store.close()
    assert not StoreAccess([]).enabled


def test_chunks_read_from_a_shard_are_kept_in_the_host_tier(tmp_path):
    from services.kvstore import BackgroundServer, KVStoreClient, StoreConfig

    srv = BackgroundServer(StoreConfig(dram_bytes=64 << 20))
    try:
        kv = layers(2, 4, 7.0)
        with KVStoreClient(srv.address, timeout=30) as client:
            client.put("z", kv, model_fingerprint="m")
        store = StoreAccess([srv.address], host_bytes=1 << 20)
        assert store.lookup(["z"]) == {"z": "dram"}
        first = list(store.fetcher({"z": "dram"})("z"))          # streamed from the shard...
        assert store.lookup(["z"]) == {"z": Tier.HOST}                 # ...and kept once it ended whole
        again = list(store.fetcher({"z": Tier.HOST})("z"))
        assert all(torch.equal(a.k, b.k) and torch.equal(a.v, b.v) for a, b in zip(first, again))
        assert torch.equal(again[1].v, kv[1][1])
        store.close()
    finally:
        srv.stop()


@pytest.mark.slow
def test_a_chunk_evicted_from_the_device_comes_back_from_the_host_tier(tiny_model):
    from services.cluster.sampling import read_sampling
    from services.engine import Engine
    from services.prefill.controller import LoadingController
    from services.prefill.metrics import PrefillMetrics
    from services.prefill.worker import PrefillJob, PrefillWorker

    eng = Engine.load(tiny_model, kv_cache_bytes=64 << 20)
    a, b = docs(2, 40, seed=91)
    store = StoreAccess([], host_bytes=64 << 20)
    worker = PrefillWorker(eng, store, LoadingController(), PrefillMetrics())
    sampling = read_sampling(pb.SamplingParams(max_new_tokens=4), None)
    job = PrefillJob("r", (tuple(a), tuple(b)), (5, 6, 7), "tessera", 0.15, sampling)
    first = worker.prefill(job)
    assert first.tier_tokens == {"computed": 80}
    assert first.storing == ()                       # no shard: nothing queued for the decode worker to wait on
    assert worker.reset(device_only=True) == 2       # the device cache forgets both chunks
    again = worker.prefill(job)
    assert again.tier_tokens == {Tier.HOST: 80}
    assert again.loaded_bytes == 80 * worker.kv_bytes_per_token   # both chunks streamed in, none computed
    assert torch.equal(again.handoff.logits, first.handoff.logits)   # the same KV, so the same logits
    assert again.first_token == first.first_token
    worker.reset()                                   # a full reset empties the host tier too
    assert store.lookup([eng.chunk_id(a)]) == {}


def test_store_access_prefetch_reads_shard_chunks_into_the_host_tier():
    from services.kvstore import BackgroundServer, KVStoreClient, StoreConfig

    srv = BackgroundServer(StoreConfig(dram_bytes=64 << 20))
    try:
        with KVStoreClient(srv.address, timeout=30) as client:
            for name in ("p", "q"):
                client.put(name, layers(2, 3, 1.0), model_fingerprint="m")
        store = StoreAccess([srv.address], host_bytes=1 << 20)
        assert store.prefetch(["p", "q", "missing"]) == 2
        assert store.lookup(["p", "q", "missing"]) == {"p": Tier.HOST, "q": Tier.HOST}
        assert store.prefetch(["p"]) == 1                      # already held: nothing read again
        store.close()
        assert StoreAccess([srv.address]).prefetch(["p"]) == 0   # no host tier: nothing kept
    finally:
        srv.stop()


def test_registered_chunks_reach_the_decode_workers_host_tier(inproc, reference):
    from services.sdk import ChunkId, Client

    a, b, *more = docs(7, 24, seed=93)        # more chunks than the gateway warms at once (REGISTER_GROUP)
    with Client(inproc.address, token=inproc.token, timeout=60) as client:
        registered = client.register_chunks([a, b, *more, a])
        assert [r.num_tokens for r in registered] == [24] * 8 and registered[0].chunk_id == registered[-1].chunk_id
        assert all(r.stored for r in registered)
        host = inproc.decode.servicer.store.host
        assert all(r.chunk_id in host for r in registered)     # prefetched before RegisterChunks returned
        registered = registered[:2]
        out = list(client.generate(chunks=[ChunkId(r.chunk_id) for r in registered], suffix=[3, 4],
                                   max_new_tokens=4, temperature=0.0))
    tokens = [t for ev in out for t in ev.token_ids]
    assert tokens == reference.generate(chunks=[a, b], suffix=[3, 4], max_new_tokens=4, temperature=0.0)


def test_registering_stores_a_chunk_larger_than_the_device_cache(tiny_model):
    from services.engine import Engine
    from services.kvstore import BackgroundServer, StoreConfig
    from services.prefill.controller import LoadingController
    from services.prefill.metrics import PrefillMetrics
    from services.prefill.worker import PrefillWorker

    eng = Engine.load(tiny_model, kv_cache_bytes=64 << 20, chunk_cache_bytes=32768)   # one block: a chunk is evicted on release
    (a,) = docs(1, 40, seed=95)
    srv = BackgroundServer(StoreConfig(dram_bytes=64 << 20))
    try:
        store = StoreAccess([srv.address], host_bytes=64 << 20)
        worker = PrefillWorker(eng, store, LoadingController(), PrefillMetrics())
        assert worker.warm([a]) == [True]
        cid = eng.chunk_id(a)
        assert cid not in eng.cache                          # gone from the device, yet stored and kept
        assert store.lookup([cid], host=False) == {cid: "dram"} and cid in store.host
        store.close()
    finally:
        srv.stop()


@pytest.mark.parametrize("local", [True, False])
def test_a_pass_waits_for_loads_from_host_memory_but_not_for_slow_streams(local):
    import threading

    from services.engine.kv.loader import ChunkLoad, LayerGate

    gate_open = threading.Event()

    def layers():
        gate_open.wait(5)                 # the load delivers only once the test lets it
        for i in range(2):
            yield StreamedLayer(i, torch.zeros(1), torch.zeros(1))

    load = ChunkLoad("c" * 12, [1], layers(), lambda *a: None, 2, local=local)
    load.start()
    threading.Timer(0.05, gate_open.set).start()
    assert LayerGate([load], lambda ld: None).settled(0.0) is local   # a local load is waited for
    load.join()
    assert LayerGate([load], lambda ld: None).settled(0.0)


def test_host_streams_are_marked_local():
    host = HostChunks(1 << 20)
    host.put("x", layers(2, 2, 1.0))
    stream = host.get("x").stream()
    assert stream.local and [i for i, _, _ in stream] == [0, 1]
