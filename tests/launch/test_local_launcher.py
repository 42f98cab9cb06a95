"""The Ray-free launcher: every service in its own child process, outputs equal the engine's."""

from __future__ import annotations

import pytest

from services.sdk import Client

from tests.helpers import docs


@pytest.fixture(scope="module")
def local_cluster(tiny_model, tmp_path_factory):
    from services.cluster.config import ClusterConfig
    from services.launch.local import start_local_cluster

    cfg = ClusterConfig(model_dir=tiny_model, store_dir=str(tmp_path_factory.mktemp("rocksdb")),
                        kv_cache_bytes=64 << 20, namespace="tessera-test-local")
    cluster = start_local_cluster(cfg)
    yield cluster
    cluster.stop()
    assert all(not c.process.is_alive() for c in cluster.children.values())


@pytest.mark.slow
def test_children_are_separate_processes(local_cluster):
    import os

    pids = {c.process.pid for c in local_cluster.children.values()}
    assert len(pids) == 4 and os.getpid() not in pids
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


def test_workers_get_a_gpu_each_when_there_are_enough_and_share_them_round_robin_otherwise():
    from services.launch.local import worker_gpus

    assert worker_gpus(2, ["0", "1"]) == ["0", "1"]
    assert worker_gpus(3, ["4", "5", "6", "7"]) == ["4", "5", "6"]
    assert worker_gpus(4, ["0", "1"]) == ["0", "1", "0", "1"]
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
