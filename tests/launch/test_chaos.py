"""Chaos soak: a prefill worker, a decode worker, a store shard and a retrieval index service SIGKILLed in turn while
two clients send prompts and register chunks; every completed output is the fault-free one and no acknowledged chunk
is lost."""

from __future__ import annotations

import json
import time
from dataclasses import asdict

import pytest

from services.launch.chaos import Kill, SoakReport, SoakSettings, run_soak

from tests.helpers import start_ray_cluster

NAMESPACE = "tessera-test-chaos"


@pytest.fixture(scope="module")
def cluster(local_ray, tiny_model, tmp_path_factory):
    c = start_ray_cluster(tiny_model, tmp_path_factory.mktemp("rocksdb"), NAMESPACE, prefill=2, decode=2, stores=1,
                          max_restarts=-1)
    yield c
    c.stop()


@pytest.mark.parametrize("fields, message", [
    (dict(duration_s=10, requests=10), "one of duration_s and requests, not both"),
    (dict(requests=0), "requests must be >= 1"),
    (dict(requests=10, retrieval_share=1.5), "retrieval_share must be in"),
    (dict(duration_s=0), "duration_s must be in"),
    (dict(roles=("prefill", "gpu")), "roles must be distinct names"),
    (dict(roles=("store", "store")), "roles must be distinct names"),
    (dict(roles=()), "roles must be distinct names"),
    (dict(kill_every_s=0), "kill_every_s must be > 0"),
    (dict(concurrency=0), "concurrency must be in"),
    (dict(registered=13), "registered must be in"),
    (dict(register_share=1.0), "register_share must be in"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else "")
def test_settings_refuse_what_no_soak_can_run(fields, message):
    with pytest.raises(ValueError, match=message):
        SoakSettings(**fields)


def test_settings_default_to_a_minute_unless_bounded_by_requests():
    assert SoakSettings().duration_s == 60.0
    assert (SoakSettings(requests=50).duration_s, SoakSettings(requests=50).requests) == (None, 50)


def test_report_is_ok_only_without_mismatch_loss_or_unserved_kill():
    def report(**fields):
        base = dict(settings=asdict(SoakSettings()), sent=3, completed=3,
                    kills=[Kill("store", "tessera-store-0", 1.0, 2.0, served_after=True)])
        return SoakReport(**{**base, **fields})

    assert report().ok
    assert not report(mismatches=1).ok
    assert not report(lost=["abc"]).ok
    assert not report(completed=0).ok
    assert not report(kills=[Kill("decode", "tessera-decode-0", 1.0, 2.0, served_after=False)]).ok
    assert not report(kills=[Kill("decode", "tessera-decode-0", 1.0, None, served_after=True)]).ok
    assert not report(problems=["tessera-prefill-1 did not answer before its kill"]).ok
    out = json.loads(json.dumps(report().to_dict()))
    assert out["ok"] and out["kills_by_role"] == {"store": 1} and out["lost_count"] == 0
    assert "result                     OK" in report().table()


@pytest.mark.slow
def test_soak_survives_a_kill_of_each_role(cluster):
    # four kills need four restarts and the pauses between: 4-14 s each on a 2-core machine alone, up to ~20 beside
    # another test worker (a clean clone's run at 62a9feb: prefill back after 19.3 s, the index kill not reached in 50)
    settings = SoakSettings(duration_s=70, concurrency=2, kill_every_s=3, max_kills=4, seed=7, max_new_tokens=6,
                            prompts=12, docs=8, registered=3, register_share=0.15, restart_timeout_s=90,
                            settle_timeout_s=90, roles=("prefill", "decode", "store", "index"), retrieval_share=0.3)
    t0 = time.monotonic()
    report = run_soak(cluster, settings, say=lambda m: print(f"{time.monotonic() - t0:6.1f} s  {m}"))
    print(report.table())
    assert report.mismatches == 0, report.mismatch_examples
    assert report.lost == []
    assert report.kills_by_role == {"prefill": 1, "decode": 1, "store": 1, "index": 1}, report.kills
    assert report.restarts == 4 and all(k.served_after for k in report.kills)
    assert report.completed > 0 and report.acknowledged >= 3
    assert 0 < report.retrieval_completed < report.completed          # both decodings served, and checked
    assert report.ok, report.table()
