"""Chaos soak: a prefill worker, a decode worker and a store shard SIGKILLed in turn while two clients send
prompts and register chunks; every completed output is the fault-free one and no acknowledged chunk is lost."""

from __future__ import annotations

import pytest

from services.cluster.chaos import SoakSettings, run_soak

from .helpers import start_ray_cluster

NAMESPACE = "tessera-test-chaos"


@pytest.fixture(scope="module")
def cluster(local_ray, tiny_model, tmp_path_factory):
    c = start_ray_cluster(tiny_model, tmp_path_factory.mktemp("rocksdb"), NAMESPACE, prefill=2, decode=2, stores=1,
                          max_restarts=-1)
    yield c
    c.stop()


@pytest.mark.slow
def test_soak_survives_a_kill_of_each_role(cluster):
    settings = SoakSettings(duration_s=20, concurrency=2, kill_every_s=3, max_kills=3, seed=7, max_new_tokens=6,
                            prompts=12, docs=8, registered=3, register_share=0.15, restart_timeout_s=90,
                            settle_timeout_s=90)
    report = run_soak(cluster, settings)
    print(report.table())
    assert report.mismatches == 0, report.mismatch_examples
    assert report.lost == []
    assert report.kills_by_role == {"prefill": 1, "decode": 1, "store": 1}, report.kills
    assert report.restarts == 3
    assert report.completed > 0 and report.acknowledged >= 3
    assert report.ok, report.table()
