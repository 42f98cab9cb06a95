"""The gateway's router: chunk residency against load, GPU colocation, failed workers; and the status poll
that tells it a worker's GPU."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.router import NoWorker, Router, WorkerView
from services.rpc import tessera_pb2 as pb


def router_with(*views: WorkerView) -> Router:
    r = Router(load_penalty=0.25)
    for v in views:
        r.add(v)
    return r


def test_router_prefers_the_worker_holding_the_chunks():
    r = router_with(WorkerView("p0", "prefill", "a"), WorkerView("p1", "prefill", "b", resident=frozenset({"x", "y"})),
                    WorkerView("d0", "decode", "c"))
    assert r.pick_prefill(("x", "y"), (100, 100)).name == "p1"


def test_load_only_routing_ignores_residency_and_spreads_by_load():
    r = Router(residency=False)
    for v in (WorkerView("p0", "prefill", "a"), WorkerView("p1", "prefill", "b", resident=frozenset({"x", "y"}))):
        r.add(v)
    picked = [r.pick_prefill(("x", "y"), (100, 100)).name for _ in range(4)]
    assert sorted(picked) == ["p0", "p0", "p1", "p1"]       # the resident chunks pull nothing to p1
    r.workers["p0"].in_flight += 1
    assert r.pick_prefill(("x", "y"), (100, 100)).name == "p1"   # the less loaded one
    r.workers["p1"].in_flight += 3
    assert r.pick_prefill(("x", "y"), (100, 100)).name == "p0"


def test_a_gateway_with_an_unknown_routing_is_refused():
    from services.cluster.config import ClusterConfig
    from services.gateway.server import create_server

    with pytest.raises(ValueError, match="routing must be 'residency' or 'load'"):
        asyncio.run(create_server("/nonexistent", [("p", "prefill", "a"), ("d", "decode", "b")], routing="lru"))
    with pytest.raises(ValueError, match="--routing"):
        ClusterConfig(model_dir=".", routing="random")


def test_router_weighs_residency_by_tokens():
    r = router_with(WorkerView("p0", "prefill", "a", resident=frozenset({"small"})),
                    WorkerView("p1", "prefill", "b", resident=frozenset({"big"})))
    assert r.pick_prefill(("small", "big"), (10, 500)).name == "p1"


def test_router_load_outweighs_a_small_residency_gain():
    busy = WorkerView("p1", "prefill", "b", resident=frozenset({"x"}), in_flight=4)
    r = router_with(WorkerView("p0", "prefill", "a"), busy)
    assert r.pick_prefill(("x", "z"), (100, 100)).name == "p0"


def test_router_spreads_equal_workers_and_counts_in_flight():
    r = router_with(WorkerView("d0", "decode", "a"), WorkerView("d1", "decode", "b"))
    first, second = r.pick_decode(), r.pick_decode()
    assert {first.name, second.name} == {"d0", "d1"}
    assert first.in_flight == second.in_flight == 1
    r.done(first)
    assert r.pick_decode().name == first.name


def test_router_prefers_a_decode_worker_on_the_prefill_workers_gpu_within_the_bonus():
    gpu0, gpu1 = ("host", "GPU-0"), ("host", "GPU-1")
    p = WorkerView("p0", "prefill", "a", gpu=gpu0)
    near = WorkerView("d0", "decode", "b", gpu=gpu0, in_flight=3)
    far = WorkerView("d1", "decode", "c", gpu=gpu1)
    r = router_with(p, near, far)
    assert r.colocate_bonus == 8
    assert r.pick_decode(near=p).name == "d0"          # 3 in flight on the same GPU beats 0 on another
    near.in_flight = 9                                  # the pick above made it 4; past the bonus now
    assert r.pick_decode(near=p).name == "d1"
    far.in_flight = near.in_flight = 0
    assert {r.pick_decode().name for _ in range(2)} == {"d0", "d1"}   # no prefill worker given: load alone
    cpu = WorkerView("p1", "prefill", "d")             # a worker with no GPU shares none
    assert r.pick_decode(near=cpu).name in {"d0", "d1"}
    with pytest.raises(ValueError, match="colocate_bonus"):
        Router(colocate_bonus=-1)


def test_router_avoids_failed_workers_then_comes_back_to_them():
    p0 = WorkerView("p0", "prefill", "a", resident=frozenset({"x"}), healthy=False)
    p1 = WorkerView("p1", "prefill", "b")
    r = router_with(p0, p1, WorkerView("d0", "decode", "c"))
    assert r.pick_prefill(("x",), (10,)).name == "p1"                 # healthy beats resident
    assert r.pick_prefill(("x",), (10,), avoid={"p1"}).name == "p1"   # healthy, though tried, beats down
    p1.healthy = False
    assert not r.ready()
    assert r.pick_prefill(("x",), (10,), avoid={"p1"}).name == "p0"   # all down: one not tried yet
    assert r.pick_prefill(("x",), (10,), avoid={"p0", "p1"}).name in {"p0", "p1"}
    p0.healthy = True
    assert r.ready()
    with pytest.raises(NoWorker, match="no decode worker"):
        router_with(p0).pick_decode()


def test_a_status_poll_records_the_workers_gpu():
    from services.gateway.peers import Peers

    class Stub:
        def __init__(self, st):
            self.st = st

        async def Status(self, request, timeout):  # noqa: N802 - the RPC's name
            return self.st

    peers = Peers(Router(), metrics=None)
    gpu_worker, cpu_worker = WorkerView("d0", "decode", "a"), WorkerView("d1", "decode", "b")
    status = {"d0": pb.WorkerStatus(host_id="h", device_uuid="GPU-7"), "d1": pb.WorkerStatus(host_id="h")}
    peers._stub = lambda w: Stub(status[w.name])
    for w in (gpu_worker, cpu_worker):
        asyncio.run(peers._poll(w))
    assert gpu_worker.gpu == ("h", "GPU-7") and cpu_worker.gpu is None
