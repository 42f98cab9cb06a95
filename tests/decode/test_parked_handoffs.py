"""The decode worker's parked hand-offs: those nobody claims within handoff_wait_s are dropped."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace


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
