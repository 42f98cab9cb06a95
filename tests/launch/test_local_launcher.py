"""The Ray-free launcher: every service in its own child process, outputs equal the engine's (hand-offs' K/V read by
the decode worker over NIXL: handoff_transport="nixl"); a retrieval decode keeps its K/V in the decode worker's index
service, which answers the roles the policy names only."""

from __future__ import annotations

import pytest

from services.sdk import Client

from tests.helpers import docs


@pytest.fixture(scope="module")
def local_cluster(tiny_model, tmp_path_factory):
    from services.cluster.config import ClusterConfig, PrefillSettings
    from services.launch.local import start_local_cluster

    cfg = ClusterConfig(model_dir=tiny_model, store_dir=str(tmp_path_factory.mktemp("rocksdb")),
                        kv_cache_bytes=64 << 20, namespace="tessera-test-local",
                        prefill_settings=PrefillSettings(handoff_transport="nixl"))
    cluster = start_local_cluster(cfg)
    yield cluster
    cluster.stop()
    assert all(not c.process.is_alive() for c in cluster.children.values())


@pytest.mark.slow
def test_children_are_separate_processes(local_cluster):
    import os

    pids = {c.process.pid for c in local_cluster.children.values()}
    assert len(pids) == 5 and os.getpid() not in pids          # store, index, prefill, decode, gateway
    assert set(local_cluster.metrics) == set(local_cluster.addresses) == set(local_cluster.children)


@pytest.mark.parametrize("mode", ("full", "tessera"))
@pytest.mark.slow
def test_local_cluster_output_equals_engine_generate(local_cluster, reference, mode):
    chunks, suffix = docs(3, 40, seed=21), [5, 6, 7]
    with Client(local_cluster.gateway_address, timeout=120) as client:
        for _ in range(2):  # cold, then with the chunks cached (tessera: from the device cache / store)
            got = client.complete(chunks, suffix, max_new_tokens=8, mode=mode, recompute_ratio=0.15,
                                  stop_token_ids=[])
            want = reference.generate(chunks, suffix, max_new_tokens=8, mode=mode, recompute_ratio=0.15,
                                      stop_token_ids=[])
            assert list(got.token_ids) == want
            assert sum(got.stats.chunk_tokens_by_tier.values()) == 120
            assert got.stats.transport == "nixl" and got.stats.handoff_bytes > 0


def test_workers_get_a_gpu_each_when_there_are_enough_and_share_them_round_robin_otherwise():
    from services.launch.local import worker_gpus

    assert worker_gpus(2, ["0", "1"]) == ["0,1", "1,0"]
    assert worker_gpus(3, ["4", "5", "6", "7"]) == ["4,5,6,7", "5,4,6,7", "6,4,5,7"]
    assert worker_gpus(4, ["0", "1"]) == ["0,1", "1,0", "0,1", "1,0"]
    assert worker_gpus(2, ["3"]) == [None, None] and worker_gpus(2, []) == [None, None]


def test_a_child_starts_with_its_gpus_and_the_parent_keeps_its_environment(monkeypatch):
    import os
    from types import SimpleNamespace

    from services.launch import local

    seen = []

    class FakeProcess:  # records the environment a spawned child would start with
        def __init__(self, **kwargs):
            self.kwargs = kwargs

        def start(self):
            seen.append(os.environ.get("CUDA_VISIBLE_DEVICES"))

    class End:
        def close(self):
            pass

    Ctx = SimpleNamespace(Process=FakeProcess, Pipe=lambda: (End(), End()))

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    children = {}
    local._spawn(Ctx, type("Spec", (), {"name": "tessera-decode-0"})(), children, "1")
    local._spawn(Ctx, type("Spec", (), {"name": "tessera-store-0"})(), children)
    assert seen == ["1", "0,1"] and os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    local._spawn(Ctx, type("Spec", (), {"name": "tessera-prefill-0"})(), children, "0")
    assert seen[-1] == "0" and "CUDA_VISIBLE_DEVICES" not in os.environ
    assert set(children) == {"tessera-decode-0", "tessera-store-0", "tessera-prefill-0"}


def _index_samples(url: str) -> dict[str, float]:
    import urllib.request

    page = urllib.request.urlopen(url, timeout=10).read().decode()
    return {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in page.splitlines() if ln and not ln.startswith("#")}


@pytest.mark.slow
def test_workers_on_the_stores_host_read_its_shared_memory_tier_and_answer_the_same(local_cluster, reference):
    """The store shard's DRAM tier is in /dev/shm (where the machine has one): with the workers' device caches
    dropped, the chunks come from the store, read from its files by the workers themselves, and the tokens stay."""
    import os

    from services.kvstore.store import shm_room

    if local_cluster.shm_scratch is None:
        pytest.skip("no writable /dev/shm here: the tier stays in the store's memory")
    if not os.listdir(local_cluster.shm_scratch):       # the store found no room for its budget there
        assert shm_room(local_cluster.shm_scratch) < local_cluster.config.store_dram_bytes
        pytest.skip("/dev/shm has no room for the store's DRAM budget here: the tier stays in its memory")
    assert os.listdir(local_cluster.shm_scratch) == ["tessera-store-0"]
    chunks, suffix = docs(3, 40, seed=33), [7, 8, 9]
    url = local_cluster.metrics["tessera-store-0"]
    want = reference.generate(chunks, suffix, max_new_tokens=6, mode="tessera", recompute_ratio=0.15,
                              stop_token_ids=[])
    with Client(local_cluster.gateway_address, timeout=120) as client:
        client.complete(chunks, suffix, max_new_tokens=6, mode="tessera", recompute_ratio=0.15, stop_token_ids=[])
        before = _index_samples(url).get("tessera_kvstore_local_gets_total", 0)
        client.reset_caches(device_only=True)
        got = client.complete(chunks, suffix, max_new_tokens=6, mode="tessera", recompute_ratio=0.15,
                              stop_token_ids=[])
    assert list(got.token_ids) == want
    assert got.stats.chunk_tokens_by_tier.get("dram", 0) > 0
    assert _index_samples(url)["tessera_kvstore_local_gets_total"] > before


@pytest.mark.slow
def test_a_retrieval_decode_keeps_its_kv_in_the_decode_workers_index_service(local_cluster, reference):
    """Every key a retrieval step scanned was scanned by the index service, which held the sequence's K/V while it
    decoded and dropped them when it ended; retrieving every key generates the engine's dense tokens. The middle
    chunk, wholly offloaded, was searched through its own index, which the service keeps for later requests."""
    chunks, suffix = docs(3, 48, seed=9), [4, 5, 6]
    url = local_cluster.metrics["tessera-index-0"]
    before = _index_samples(url)
    with Client(local_cluster.gateway_address, timeout=120) as client:
        got = client.complete(chunks, suffix, max_new_tokens=6, stop_token_ids=[], decode="retrieval",
                              retrieval_k=4096, sink_tokens=4, window_tokens=8)
    assert list(got.token_ids) == reference.generate(chunks, suffix, max_new_tokens=6, stop_token_ids=[])
    after = _index_samples(url)
    d = got.stats.decode
    assert d.policy == "retrieval" and d.steps == 5 and d.keys_scanned > 0
    assert after["tessera_index_keys_scanned_total"] - before.get("tessera_index_keys_scanned_total", 0) == \
        d.keys_scanned
    assert after["tessera_index_keys_offloaded_total"] > before.get("tessera_index_keys_offloaded_total", 0)
    assert after["tessera_index_search_seconds_count"] > before.get("tessera_index_search_seconds_count", 0)
    assert after["tessera_index_owners"] == 0 and after["tessera_index_kv_bytes"] == 0    # dropped as it ended
    assert after["tessera_index_chunk_indexes"] >= 1 and after["tessera_index_chunk_index_bytes"] > 0
    # and the store keeps the chunk's index beside it, for every decode worker: under mutual TLS too
    import time

    from services.cluster.security import ClusterTLS
    from services.engine.kv.chunk_ids import index_entry_id
    from services.kvstore import KVStoreClient

    entry = index_entry_id(reference.chunk_id(chunks[1]))
    assert local_cluster.config.internal_tls      # the store takes the entry from a decode worker under mutual TLS
    tls = ClusterTLS.load(local_cluster.certs_scratch, "prefill")
    with KVStoreClient(local_cluster.addresses["tessera-store-0"], tls=tls) as store:
        for _ in range(60):             # written after the build, in the background
            if store.lookup([entry])[0].found:
                break
            time.sleep(0.5)
        assert store.lookup([entry])[0].found


@pytest.mark.slow
def test_the_index_service_proves_its_role_and_refuses_callers_the_policy_does_not_name(local_cluster):
    import grpc
    import numpy as np

    from services.cluster.security import ClusterTLS
    from services.index.client import IndexClient

    address, certs = local_cluster.addresses["tessera-index-0"], local_cluster.certs_scratch
    q = np.ones((1, 4, 16), np.float32)
    clients = {role: IndexClient(address, tls=ClusterTLS.load(certs, role), timeout=10)
               for role in ("gateway", "prefill", "decode")}
    try:
        assert clients["gateway"].held()[0] == 0          # Status is open to the gateway; the handshake proved "index"
        for role in ("gateway", "prefill"):
            with pytest.raises(grpc.RpcError) as err:
                clients[role].attend(0, ["seq-x"], q, 5, 0.1)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, role
        with pytest.raises(grpc.RpcError) as err:          # a decode worker gets in: it is told nothing is held
            clients["decode"].attend(0, ["seq-x"], q, 5, 0.1)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        for c in clients.values():
            c.close()


@pytest.mark.slow
def test_without_its_index_service_the_decode_worker_fails_retrieval_clearly_and_serves_the_rest(local_cluster,
                                                                                                  reference):
    """Last in this module: it stops the index service. A retrieval request then fails, saying the index service
    failed, within its deadline; the decode worker keeps serving dense requests."""
    from services.sdk.errors import TesseraError

    child = local_cluster.children["tessera-index-0"]
    child.conn.send("stop")
    child.process.join(30)
    assert not child.process.is_alive()
    chunks, suffix = docs(2, 40, seed=31), [7, 8]
    with Client(local_cluster.gateway_address, timeout=60) as client:
        with pytest.raises(TesseraError) as err:
            client.complete(chunks, suffix, max_new_tokens=4, stop_token_ids=[], decode="retrieval", retrieval_k=8,
                            sink_tokens=4, window_tokens=8)
        assert err.value.code == "INTERNAL"
        assert "retrieval index service failed to hold layer 0 of the sequence's keys: UNAVAILABLE" in err.value.details
        got = client.complete(chunks, suffix, max_new_tokens=4, stop_token_ids=[])
        assert list(got.token_ids) == reference.generate(chunks, suffix, max_new_tokens=4, stop_token_ids=[])
