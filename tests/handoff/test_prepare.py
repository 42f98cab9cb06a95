"""A received hand-off made ready off the engine thread (services/handoff/prepare.py): it waits for a chunk still
being stored, and says where each chunk came from."""

from __future__ import annotations

import pytest

from services.rpc import tessera_pb2 as pb
from services.engine.kv.loader import numbered


class _LandingStore:
    """A store where chunk ``cid`` becomes visible at the ``after``-th lookup (a write still in flight)."""

    enabled = True

    def __init__(self, cid, layers, after):
        self.cid, self.layers, self.after, self.lookups = cid, layers, after, 0

    def lookup(self, ids):
        self.lookups += 1
        return {self.cid: "dram"} if self.cid in ids and self.lookups >= self.after else {}

    def fetcher(self, present, device=None):
        return lambda cid: numbered(self.layers) if cid in present else None

    @staticmethod
    def in_arena(t) -> bool:
        return False


@pytest.mark.parametrize("wait_s, fetched", [(5.0, True), (0.0, False)])
def test_decode_waits_for_a_chunk_still_being_stored(tiny_model, wait_s, fetched):
    from services.handoff.transport import ReceivedHandoff
    from services.handoff.prepare import prepare
    from services.engine import Engine

    from tests.helpers import docs

    prefill, decode = Engine.load(tiny_model, kv_cache_bytes=64 << 20), Engine.load(tiny_model, kv_cache_bytes=64 << 20)
    (a,) = docs(1, 32, seed=78)
    _, h = prefill.prefill_handoff([a], [2], recompute_ratio=0.15)
    cid = prefill.chunk_id(a)
    store = _LandingStore(cid, prefill.export_chunk(cid), after=3)
    header = pb.HandoffHeader(request_id="r", kind="engine", storing=[cid])
    prepared = prepare(ReceivedHandoff(header, h.to_bytes()), decode, store, store_wait_s=wait_s)
    assert (cid in prepared.fetched) is fetched          # waited for the write, or left it to be computed
    assert store.lookups == (3 if fetched else 1)
    assert prepared.sources == {"gpu": 0, "host": 0, "store": int(fetched), "computed": int(not fetched)}
    assert (prepared.store_wait_s is not None) is (wait_s > 0)
    assert prepared.layout is not None and prepared.layout.handoff is prepared.handoff   # made here, not at admission
    seq = decode.import_handoff(prepared.handoff, fetch=lambda c: iter(prepared.fetched[c]) if c in prepared.fetched else None,
                                layout=prepared.layout)
    decode.release(seq)


class _CheckedLater:
    """A fetch as a read onto the device gives it (kvio.DeviceLayers): layers at once, checked by ``verify``."""

    local = True

    def __init__(self, layers, passes: bool) -> None:
        self.layers, self.passes, self.verified = layers, passes, 0

    def __iter__(self):
        return iter(numbered(self.layers))

    def verify(self) -> None:
        self.verified += 1
        if not self.passes:
            raise RuntimeError("checksum mismatch of the bytes landed from the store's arena")


@pytest.mark.parametrize("passes", [True, False])
def test_a_chunk_read_onto_the_device_is_verified_before_the_engine_gets_it(tiny_model, passes):
    """The helper thread verifies a checked-later read before handing it on; one that fails is left to be computed
    at admission (never handed to the engine)."""
    from services.engine import Engine
    from services.handoff.prepare import prepare
    from services.handoff.transport import ReceivedHandoff

    from tests.helpers import docs

    prefill, decode = Engine.load(tiny_model, kv_cache_bytes=64 << 20), Engine.load(tiny_model, kv_cache_bytes=64 << 20)
    (a,) = docs(1, 32, seed=79)
    _, h = prefill.prefill_handoff([a], [2], recompute_ratio=0.15)
    cid = prefill.chunk_id(a)
    store = _LandingStore(cid, prefill.export_chunk(cid), after=1)
    reads = []

    def fetcher(present, device=None):
        assert device == decode.device          # the engine's device: the store may read onto it
        reads.append(_CheckedLater(store.layers, passes))
        return lambda c: reads[-1] if c in present else None

    store.fetcher = fetcher
    prepared = prepare(ReceivedHandoff(pb.HandoffHeader(request_id="r", kind="engine"), h.to_bytes()), decode, store)
    assert reads[0].verified == 1 and (cid in prepared.fetched) is passes
    assert prepared.sources == {"gpu": 0, "host": 0, "store": int(passes), "computed": int(not passes)}
    seq = decode.import_handoff(prepared.handoff, fetch=lambda c: iter(prepared.fetched[c]) if c in prepared.fetched else None)
    decode.release(seq)


@pytest.mark.cuda
def test_staging_keeps_layers_already_on_the_gpu_and_copies_the_rest_in_order():
    """_stage: a chunk read onto the GPU (and checked there) is kept as it is; host layers are copied aside; every
    chunk's layers keep their order, and the event covers the copies."""
    import torch

    from services.handoff.prepare import _stage

    dev = torch.device("cuda")
    host = list(numbered([(torch.full((2, 1, 4), float(i)), torch.full((2, 1, 4), -float(i))) for i in range(3)]))
    on_gpu = list(numbered([(torch.full((2, 1, 4), 10.0 + i, device=dev),
                             torch.full((2, 1, 4), -10.0 - i, device=dev)) for i in range(3)]))
    out, ready = _stage({"a": host, "b": on_gpu}, dev)
    ready.synchronize()
    assert [item.layer for item in out["a"]] == [0, 1, 2] and [item.layer for item in out["b"]] == [0, 1, 2]
    assert all(item.k.is_cuda and item.v.is_cuda for layers in out.values() for item in layers)
    assert all(out["b"][i].k is on_gpu[i].k for i in range(3))                 # not copied again
    assert all(torch.equal(out["a"][i].k.cpu(), host[i].k) and torch.equal(out["a"][i].v.cpu(), host[i].v)
               for i in range(3))
    out, ready = _stage({"b": on_gpu}, dev)                                      # nothing on the host: no copy
    ready.synchronize()
    assert out["b"][0].k is on_gpu[0].k


def test_a_chunk_evicted_after_preparation_is_read_off_the_engine_thread_before_admission(tiny_model):
    """A shared chunk resident in the decode engine when its hand-off was prepared (so not fetched) and evicted before
    the admission: the batcher sends the job back to a helper (``restage``), which reads the chunk
    (``fetch_more``), and admits it when it returns; the engine thread reads nothing from the store, and the tokens
    are those of the same hand-off decoded with the chunk resident."""
    import threading

    from services.decode.batcher import Batcher, DecodeJob
    from services.decode.metrics import DecodeMetrics
    from services.engine import Engine
    from services.engine.sampling import SamplingParams
    from services.handoff.prepare import fetch_more, prepare
    from services.handoff.transport import ReceivedHandoff

    from tests.helpers import docs

    prefill, decode = Engine.load(tiny_model, kv_cache_bytes=64 << 20), Engine.load(tiny_model, kv_cache_bytes=64 << 20)
    a, b = docs(2, 32, seed=80)
    _, h = prefill.prefill_handoff([a, b], [2, 3], recompute_ratio=0.15)
    cid = prefill.chunk_id(a)
    store = _LandingStore(cid, prefill.export_chunk(cid), after=1)
    header = pb.HandoffHeader(request_id="r", kind="engine")

    def run(evict: bool, restage_on: bool):
        decode.cache.clear()
        warm = prepare(ReceivedHandoff(header, h.to_bytes()), decode, store)   # reads a: it is resident after
        decode.release(decode.import_handoff(warm.handoff,
                                             fetch=lambda c: iter(warm.fetched[c]) if c in warm.fetched else None))
        assert cid in decode.cache
        prepared = prepare(ReceivedHandoff(header, h.to_bytes()), decode, store)
        assert cid not in prepared.fetched                                      # resident: not read
        if evict:
            assert decode.cache.drop([cid]) == 1
        engine_reads, restaged, out, done = [], [], [], threading.Event()

        def restage(job, chunk_ids):
            restaged.append((threading.current_thread().name, list(chunk_ids)))
            threading.Thread(target=lambda: (fetch_more(job.handoff, chunk_ids, decode, store),
                                             batcher.submit(job)), name="helper").start()

        def emit(tokens, reason, error):
            assert error is None
            out.extend(tokens)
            if reason is not None:
                done.set()

        batcher = Batcher(decode, DecodeMetrics(), 4, fetch=lambda c: engine_reads.append(c),
                          restage=restage if restage_on else None)
        try:
            batcher.submit(DecodeJob("r", prepared, SamplingParams(0.0, 1.0, 0, None, 6), emit))
            assert done.wait(30)
        finally:
            batcher.stop()
        return out, engine_reads, restaged, batcher.metrics.restaged._value.get()

    resident, reads, restaged, n = run(evict=False, restage_on=True)
    assert reads == [] and restaged == [] and n == 0
    tokens, reads, restaged, n = run(evict=True, restage_on=True)
    assert tokens == resident and reads == [] and n == 1
    assert restaged == [("decode-engine", [cid])]           # asked for on the engine thread, read by the helper
    # without a restage the engine thread reads it itself (the fallback, and the cost the restage takes off it)
    tokens, reads, restaged, n = run(evict=True, restage_on=False)
    assert reads == [cid] and n == 0


def test_a_restage_that_cannot_be_made_admits_the_hand_off_reading_its_chunks_on_the_engine_thread(tiny_model):
    """The helpers gone (a worker stopping: its executor refuses work): the job is admitted at once, its chunk read
    by the engine thread's own fetch, and the batcher goes on serving."""
    import threading

    from services.decode.batcher import Batcher, DecodeJob
    from services.decode.metrics import DecodeMetrics
    from services.engine import Engine
    from services.engine.sampling import SamplingParams
    from services.handoff.prepare import prepare
    from services.handoff.transport import ReceivedHandoff

    from tests.helpers import docs

    prefill, decode = Engine.load(tiny_model, kv_cache_bytes=64 << 20), Engine.load(tiny_model, kv_cache_bytes=64 << 20)
    (a,) = docs(1, 32, seed=81)
    _, h = prefill.prefill_handoff([a], [2], recompute_ratio=0.15)
    cid = prefill.chunk_id(a)
    decode.release(decode.import_handoff(h))            # computed there: resident
    header = pb.HandoffHeader(request_id="r", kind="engine")
    prepared = prepare(ReceivedHandoff(header, h.to_bytes()), decode, _LandingStore(cid, [], after=99))
    assert decode.cache.drop([cid]) == 1
    reads, done = [], threading.Event()

    def refuse(job, chunk_ids):
        raise RuntimeError("cannot schedule new futures after shutdown")

    batcher = Batcher(decode, DecodeMetrics(), 4, fetch=lambda c: reads.append(c), restage=refuse)
    try:
        batcher.submit(DecodeJob("r", prepared, SamplingParams(0.0, 1.0, 0, None, 3),
                                 lambda toks, reason, err: done.set() if reason is not None or err else None))
        assert done.wait(30)
        assert reads == [cid] and batcher.alive and batcher.metrics.restaged._value.get() == 0
    finally:
        batcher.stop()


def test_only_chunks_held_when_prepared_go_back_and_one_found_nowhere_goes_back_once(tiny_model):
    """A chunk the preparation looked up and did not find is not restaged (the store would not have it sooner); a
    chunk held when prepared, evicted, and then not found in the store by the helper is restaged once and then
    computed at admission."""
    import threading

    from services.decode.batcher import Batcher, DecodeJob
    from services.decode.metrics import DecodeMetrics
    from services.engine import Engine
    from services.engine.sampling import SamplingParams
    from services.handoff.prepare import fetch_more, prepare
    from services.handoff.transport import ReceivedHandoff

    from tests.helpers import docs

    prefill, decode = Engine.load(tiny_model, kv_cache_bytes=64 << 20), Engine.load(tiny_model, kv_cache_bytes=64 << 20)
    a, b = docs(2, 32, seed=82)
    _, h = prefill.prefill_handoff([a, b], [2], recompute_ratio=0.15)
    ca = prefill.chunk_id(a)
    nowhere = _LandingStore(ca, [], after=99)               # the store never has either chunk
    _, ha = prefill.prefill_handoff([a], [2], recompute_ratio=0.15)
    decode.release(decode.import_handoff(ha))               # a computed there: held; b not
    header = pb.HandoffHeader(request_id="r", kind="engine")
    prepared = prepare(ReceivedHandoff(header, h.to_bytes()), decode, nowhere)
    assert prepared.held == {ca} and prepared.unstaged(decode.cache) == []      # b: looked up, not found
    assert decode.cache.drop([ca]) == 1
    assert prepared.unstaged(decode.cache) == [ca]
    restaged, done = [], threading.Event()

    def restage(job, chunk_ids):
        restaged.append(list(chunk_ids))
        threading.Thread(target=lambda: (fetch_more(job.handoff, chunk_ids, decode, nowhere),
                                         batcher.submit(job))).start()

    batcher = Batcher(decode, DecodeMetrics(), 4, fetch=lambda c: None, restage=restage)
    try:
        batcher.submit(DecodeJob("r", prepared, SamplingParams(0.0, 1.0, 0, None, 3),
                                 lambda toks, reason, err: done.set() if reason is not None or err else None))
        assert done.wait(30)
    finally:
        batcher.stop()
    assert restaged == [[ca]] and prepared.absent == {ca}
