"""The Ray-free launcher: every service in its own child process, outputs equal the engine's."""

from __future__ import annotations

import pytest

from services.sdk import Client

from .helpers import docs


@pytest.fixture(scope="module")
def local_cluster(tiny_model, tmp_path_factory):
    from services.cluster.config import ClusterConfig
    from services.cluster.local import start_local_cluster

    cfg = ClusterConfig(model_dir=tiny_model, store_dir=str(tmp_path_factory.mktemp("rocksdb")),
                        kv_cache_bytes=64 << 20, namespace="tessera-test-local")
    cluster = start_local_cluster(cfg)
    yield cluster
    cluster.stop()
    assert all(not c.process.is_alive() for c in cluster.children.values())


def test_children_are_separate_processes(local_cluster):
    import os

    pids = {c.process.pid for c in local_cluster.children.values()}
    assert len(pids) == 4 and os.getpid() not in pids
    assert set(local_cluster.metrics) == set(local_cluster.addresses) == set(local_cluster.children)


@pytest.mark.parametrize("mode", ("full", "tessera"))
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
