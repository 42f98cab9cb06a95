"""The decode worker's hand-offs: one waits for a chunk still being stored, those nobody claims are dropped."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.rpc import tessera_pb2 as pb


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

    from tests.helpers import docs

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
