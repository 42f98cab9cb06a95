"""The prefill worker's loading controller: how much to recompute, whether to load or compute; and a chunk
computed instead of loaded is not stored again."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.prefill.controller import LoadingController
from services.rpc import tessera_pb2 as pb


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


def test_controller_keeps_the_floor_while_requests_wait_behind():
    """Recomputing past the floor is free only when the GPU would wait for the load: with requests queued behind,
    the floor, whatever the load would hide; with none, the ratio the load hides again."""
    c = LoadingController(floor=0.15, smoothing=1.0)
    c.observe(stats(chunk_tokens_computed=100, chunk_compute_seconds=1.0))
    c.observe(stats(loaded_bytes=1000, load_seconds=0.5))
    assert c.ratio(1000, 100, waiting=3) == 0.15 and c.ratio(10**6, 100, waiting=1) == 0.15
    assert c.ratio(1000, 100, waiting=0) == pytest.approx(0.5)


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


class _RecordingStore:
    """StoreAccess's surface for PrefillWorker: holds ``held``, records what is written."""

    enabled = True

    def __init__(self, held):
        self.held, self.puts = set(held), []

    def lookup(self, ids):
        return {cid: "dram" for cid in ids if cid in self.held}

    def fetcher(self, present, device=None):
        return lambda cid: None          # never asked: the controller prefers computing below

    def put_later(self, cid, layers, fingerprint=""):
        self.puts.append(cid)
        return True


def test_a_chunk_computed_instead_of_loaded_is_not_stored_again(tiny_model):
    from services.cluster.sampling import read_sampling
    from services.engine import Engine
    from services.prefill.metrics import PrefillMetrics
    from services.prefill.worker import PrefillJob, PrefillWorker

    from tests.helpers import docs

    eng = Engine.load(tiny_model, kv_cache_bytes=64 << 20)
    a, b = docs(2, 32, seed=77)
    store = _RecordingStore([eng.chunk_id(a)])
    controller = LoadingController(smoothing=1.0, probe_every=1000)
    controller.observe(stats(chunk_tokens_computed=100, chunk_compute_seconds=0.001))   # computing is cheap
    controller.observe(stats(loaded_bytes=1000, load_seconds=1.0))                      # loading is slow
    worker = PrefillWorker(eng, store, controller, PrefillMetrics())
    job = PrefillJob("r", (tuple(a), tuple(b)), (1,), "tessera", 0.15,
                     read_sampling(pb.SamplingParams(max_new_tokens=2), None))
    out = worker.prefill(job)
    assert out.tier_tokens == {"computed": 64}           # a was held by the store, yet computed here
    assert store.puts == [eng.chunk_id(b)]               # and only b, which the store lacked, is written
    assert out.storing == (eng.chunk_id(b),)              # the hand-off names it: the decode worker may wait for it


def test_with_store_loads_off_every_chunk_the_gpu_lacks_is_computed_and_nothing_held_is_stored_again(tiny_model):
    """``store_loads="never"`` (the A/B's "store path off"): a held chunk is computed even on a probe request, where
    the controller would otherwise load it, and still not written to the store again."""
    from services.cluster.sampling import read_sampling
    from services.engine import Engine
    from services.prefill.metrics import PrefillMetrics
    from services.prefill.worker import PrefillJob, PrefillWorker

    from tests.helpers import docs

    eng = Engine.load(tiny_model, kv_cache_bytes=64 << 20)
    a, b = docs(2, 32, seed=78)
    store = _RecordingStore([eng.chunk_id(a)])
    controller = LoadingController(probe_every=1, loads=False)     # nothing measured, every request a probe: loads
    assert controller.prefer_load(10**6, 100)                      # ... were they not off
    worker = PrefillWorker(eng, store, controller, PrefillMetrics())
    job = PrefillJob("r", (tuple(a), tuple(b)), (1,), "tessera", 0.15,
                     read_sampling(pb.SamplingParams(max_new_tokens=2), None))
    out = worker.prefill(job)
    assert out.tier_tokens == {"computed": 64}
    assert store.puts == [eng.chunk_id(b)]
