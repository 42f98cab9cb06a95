"""The cluster's pure parts: router, loading controller, hand-off framing, input resolution."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.cluster.transport import HandoffError, handoff_parts, probe_transport, receive_handoff
from services.gateway.router import NoWorker, Router, WorkerView
from services.prefill.controller import LoadingController
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


def stats(**kw):
    base = dict(chunk_tokens_computed=0, chunk_compute_seconds=0.0, loaded_bytes=0, load_seconds=0.0)
    return SimpleNamespace(**{**base, **kw})


def test_controller_keeps_the_floor_until_it_has_measured():
    c = LoadingController(floor=0.15)
    assert c.ratio(store_bytes=10_000, chunk_tokens=100) == 0.15
    c.observe(stats(chunk_tokens_computed=100, chunk_compute_seconds=1.0))   # 10 ms / token
    assert c.ratio(10_000, 100) == 0.15                                        # no load measured yet


def test_controller_recomputes_what_the_load_hides():
    c = LoadingController(floor=0.15, smoothing=1.0)
    c.observe(stats(chunk_tokens_computed=100, chunk_compute_seconds=1.0))   # 10 ms per token
    c.observe(stats(loaded_bytes=1000, load_seconds=0.5))                    # 0.5 ms per byte
    # loading 1000 B takes 0.5 s = recomputing 50 of 100 tokens
    assert c.ratio(1000, 100) == pytest.approx(0.5)
    assert c.ratio(100, 100) == 0.15          # a fast load: the quality floor
    assert c.ratio(10**6, 100) == 1.0         # a very slow load: recompute everything
    assert c.ratio(0, 100) == 0.15            # nothing from the store


def test_controller_ratios_come_in_steps():
    """Rounded up to multiples of 0.05: a handful of recompute sizes (graph shapes), never less recompute."""
    c = LoadingController(floor=0.15, smoothing=1.0)
    c.observe(stats(chunk_tokens_computed=100, chunk_compute_seconds=1.0))
    c.observe(stats(loaded_bytes=1000, load_seconds=0.5))
    assert c.ratio(620, 100) == pytest.approx(0.35)   # the load hides 0.31
    seen = {c.ratio(b, 100) for b in range(300, 2000, 7)}
    # 0.15, 0.20, ..., 1.0 over 243 different loads
    assert len(seen) <= 18 and all(abs(r / 0.05 - round(r / 0.05)) < 1e-9 for r in seen)
    assert all(c.ratio(b, 100) >= min(1.0, b * 0.0005 / 1.0) for b in range(300, 2000, 7))


def test_controller_loads_only_what_loads_faster_than_it_computes():
    c = LoadingController(smoothing=1.0, probe_every=4)
    assert c.prefer_load(10**6, 100)                                   # nothing measured: load
    c.observe(stats(chunk_tokens_computed=100, chunk_compute_seconds=0.1))   # 1 ms per token
    c.observe(stats(loaded_bytes=1000, load_seconds=0.5))                     # 0.5 ms per byte
    # 1000 B take 500 ms to load, their 100 tokens 100 ms to compute: computed, except on probes
    decisions = [c.prefer_load(1000, 100) for _ in range(8)]
    assert decisions.count(True) == 2 and decisions[2] and decisions[6]       # the 4th and 8th decisions
    assert all(c.prefer_load(100, 100) for _ in range(8))               # 50 ms < 100 ms: always load
    with pytest.raises(ValueError, match="probe_every"):
        LoadingController(probe_every=0)


@pytest.mark.parametrize("n", [0, 10, (1 << 20) + 5])
def test_handoff_parts_round_trip(n):
    payload = bytes(i % 251 for i in range(n))

    async def collect(parts):
        async def gen():
            for p in parts:
                yield p
        return await receive_handoff(gen())

    parts = list(handoff_parts(pb.HandoffHeader(request_id="r", kind="engine"), payload))
    assert all(len(p.data) <= 1 << 20 for p in parts[1:])
    got = asyncio.run(collect(parts))
    assert got.payload == payload and got.header.request_id == "r"


def test_damaged_handoff_is_refused():
    parts = list(handoff_parts(pb.HandoffHeader(request_id="r", kind="engine"), b"x" * 100))
    parts[1] = pb.HandoffPart(data=b"y" * 100)

    async def run(ps):
        async def gen():
            for p in ps:
                yield p
        return await receive_handoff(gen())

    with pytest.raises(HandoffError, match="bad crc32"):
        asyncio.run(run(parts))
    with pytest.raises(HandoffError, match="must start with its header"):
        asyncio.run(run(parts[1:]))


def test_transport_probe_reports_nixl():
    choice = probe_transport()
    assert choice.name == "grpc" and "nixl" in choice.detail
    import torch
    assert probe_transport(torch.device("cpu")).name == "grpc"
    assert probe_transport(torch.device("cuda", 0)).name == "cuda-ipc"   # a probe only: touches no GPU


def test_cuda_ipc_needs_one_gpu_on_one_host():
    import torch

    from services.cluster.cuda_ipc import device_uuid, host_id, placement, same_gpu, share
    me = pb.WorkerStatus(host_id=host_id(), device_uuid="GPU-1")
    assert same_gpu(me, pb.WorkerStatus(host_id=host_id(), device_uuid="GPU-1"))
    assert not same_gpu(me, pb.WorkerStatus(host_id=host_id(), device_uuid="GPU-2"))
    assert not same_gpu(me, pb.WorkerStatus(host_id="elsewhere/1", device_uuid="GPU-1"))
    assert not same_gpu(pb.WorkerStatus(host_id=host_id(), device_uuid=""),
                        pb.WorkerStatus(host_id=host_id(), device_uuid=""))   # CPU workers
    assert device_uuid(torch.device("cpu")) == ""
    assert placement(torch.device("cpu")) == {"host_id": host_id(), "device_uuid": ""}
    with pytest.raises(ValueError, match="CUDA tensor"):
        share(torch.zeros(4))


class _RecordingStore:
    """StoreAccess's surface for PrefillWorker: holds ``held``, records what is written."""

    enabled = True

    def __init__(self, held):
        self.held, self.puts = set(held), []

    def lookup(self, ids):
        return {cid: "dram" for cid in ids if cid in self.held}

    def fetcher(self, present):
        return lambda cid: None          # never asked: the controller prefers computing below

    def put_later(self, cid, layers, fingerprint=""):
        self.puts.append(cid)
        return True


def test_a_chunk_computed_instead_of_loaded_is_not_stored_again(tiny_model):
    from services.cluster.sampling import WireSampling
    from services.engine import Engine
    from services.prefill.metrics import PrefillMetrics
    from services.prefill.worker import PrefillJob, PrefillWorker

    from .helpers import docs

    eng = Engine.load(tiny_model, kv_cache_bytes=64 << 20)
    a, b = docs(2, 32, seed=77)
    store = _RecordingStore([eng.chunk_id(a)])
    controller = LoadingController(smoothing=1.0, probe_every=1000)
    controller.observe(stats(chunk_tokens_computed=100, chunk_compute_seconds=0.001))   # computing is cheap
    controller.observe(stats(loaded_bytes=1000, load_seconds=1.0))                      # loading is slow
    worker = PrefillWorker(eng, store, controller, PrefillMetrics())
    job = PrefillJob("r", (tuple(a), tuple(b)), (1,), "tessera", 0.15,
                     WireSampling.read(pb.SamplingParams(max_new_tokens=2), None))
    out = worker.prefill(job)
    assert out.tier_tokens == {"computed": 64}           # a was held by the store, yet computed here
    assert store.puts == [eng.chunk_id(b)]               # and only b, which the store lacked, is written
    assert out.storing == (eng.chunk_id(b),)              # the hand-off names it: the decode worker may wait for it


class _LandingStore:
    """A store where chunk ``cid`` becomes visible at the ``after``-th lookup (a write still in flight)."""

    enabled = True

    def __init__(self, cid, layers, after):
        self.cid, self.layers, self.after, self.lookups = cid, layers, after, 0

    def lookup(self, ids):
        self.lookups += 1
        return {self.cid: "dram"} if self.cid in ids and self.lookups >= self.after else {}

    def fetcher(self, present):
        return lambda cid: iter([(i, k, v) for i, (k, v) in enumerate(self.layers)]) if cid in present else None


@pytest.mark.parametrize("wait_s, fetched", [(5.0, True), (0.0, False)])
def test_decode_waits_for_a_chunk_still_being_stored(tiny_model, wait_s, fetched):
    from services.cluster.transport import ReceivedHandoff
    from services.decode.metrics import DecodeMetrics
    from services.decode.prepare import prepare
    from services.engine import Engine

    from .helpers import docs

    prefill, decode = Engine.load(tiny_model, kv_cache_bytes=64 << 20), Engine.load(tiny_model, kv_cache_bytes=64 << 20)
    (a,) = docs(1, 32, seed=78)
    _, h = prefill.prefill_handoff([a], [2], recompute_ratio=0.15)
    cid = prefill.chunk_id(a)
    store = _LandingStore(cid, prefill.export_chunk(cid), after=3)
    header = pb.HandoffHeader(request_id="r", kind="engine", storing=[cid])
    prepared = prepare(ReceivedHandoff(header, h.to_bytes()), decode, store, DecodeMetrics(), store_wait_s=wait_s)
    assert (cid in prepared.fetched) is fetched          # waited for the write, or left it to be computed
    assert store.lookups == (3 if fetched else 1)
    seq = decode.import_handoff(prepared.handoff, fetch=lambda c: iter(prepared.fetched[c]) if c in prepared.fetched else None)
    decode.release(seq)


def test_decode_worker_drops_handoffs_nobody_claims():
    import time as _time

    import torch

    from services.cluster.config import DecodeSettings
    from services.decode.metrics import DecodeMetrics
    from services.decode.server import DecodeServicer

    metrics = DecodeMetrics()
    eng = SimpleNamespace(device=torch.device("cpu"))
    servicer = DecodeServicer(None, eng, None, metrics, "d", "", DecodeSettings(handoff_wait_s=10.0))
    now = _time.monotonic()
    servicer._pending = {"old": (object(), now - 11.0), "new": (object(), now)}
    assert servicer._sweep() == 1 and set(servicer._pending) == {"new"}   # parked past handoff_wait_s
    servicer.settings = DecodeSettings(handoff_wait_s=0.1)                  # the timer sweeps too

    async def run():
        sweeper = asyncio.ensure_future(servicer.sweep_forever())
        for _ in range(200):                                                # bounded: 10 s at most
            if not servicer._pending:
                break
            await asyncio.sleep(0.05)
        sweeper.cancel()

    asyncio.run(run())
    assert servicer._pending == {} and metrics.handoffs_dropped._value.get() == 2


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
