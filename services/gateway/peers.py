"""The gateway's view of its workers: channels, periodic health checks and residency polls.

Every ``interval_s`` each worker's ``Status`` is called with a short deadline: success marks it
healthy and refreshes its resident chunk ids; failure marks it unhealthy (the router avoids it).
A worker that fails is asked for its address again through Ray (``resolve``), in case it came
back elsewhere after a restart; normally it comes back on the same address. ``on_ready`` learns
when the gateway can serve at all (a healthy worker of each role): its health status follows.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from services.cluster.serving import channel
from services.gateway.metrics import GatewayMetrics
from services.gateway.router import Router, WorkerView
from services.rpc import tessera_pb2 as pb
from services.rpc import tessera_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class WorkerGone(RuntimeError):
    """``resolve`` found the worker stopped for good (Ray will not restart it): requests fail fast."""


class Peers:
    def __init__(self, router: Router, metrics: GatewayMetrics, interval_s: float = 0.5,
                 resolve: Callable[[str], str | None] | None = None, cluster_tls=None) -> None:
        self.router = router
        self.cluster_tls = cluster_tls     # the gateway's ClusterTLS: workers are dialled over mutual TLS
        self.metrics = metrics
        self.interval_s = interval_s
        self.resolve = resolve             # name -> current address (via Ray), or None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._task: asyncio.Task | None = None
        self.status: dict[str, pb.WorkerStatus] = {}
        self.on_ready = None      # async fn(bool): called when "a prefill and a decode worker are healthy" flips
        self._ready: bool | None = None

    def channel(self, address: str, role: str) -> grpc.aio.Channel:
        """The channel to the ``role`` worker at ``address`` (over mutual TLS: it must prove that role)."""
        if address not in self._channels:
            self._channels[address] = channel(address, role, self.cluster_tls)
        return self._channels[address]

    def prefill_stub(self, w: WorkerView) -> pb_grpc.PrefillWorkerStub:
        return pb_grpc.PrefillWorkerStub(self.channel(w.address, "prefill"))

    def decode_stub(self, w: WorkerView) -> pb_grpc.DecodeWorkerStub:
        return pb_grpc.DecodeWorkerStub(self.channel(w.address, "decode"))

    def _stub(self, w: WorkerView):
        return self.prefill_stub(w) if w.role == "prefill" else self.decode_stub(w)

    async def poll_once(self) -> None:
        views = [w for w in self.router.workers.values() if w.role in ("prefill", "decode")]
        await asyncio.gather(*(self._poll(w) for w in views))
        healthy = {role: sum(w.healthy for w in self.router.of_role(role)) for role in ("prefill", "decode")}
        for role, n in healthy.items():
            self.metrics.healthy.labels(role).set(n)
        ready = all(healthy.values())
        if self.on_ready is not None and ready != self._ready:
            await self.on_ready(ready)
            self._ready = ready

    async def _poll(self, w: WorkerView) -> None:
        try:
            st = await self._stub(w).Status(pb.WorkerStatusRequest(), timeout=max(2 * self.interval_s, 1.0))
        except grpc.aio.AioRpcError:
            self.mark_down(w)
            return
        if not w.healthy:
            log.info("%s worker %s is healthy again", w.role, w.name)
        w.healthy, w.gone = True, ""
        w.resident = frozenset(st.resident_chunk_ids)
        w.metrics_url = st.metrics_url
        w.gpu = (st.host_id, st.device_uuid) if st.device_uuid else None
        self.status[w.name] = st

    def mark_down(self, w: WorkerView) -> None:
        if w.healthy:
            log.warning("%s worker %s at %s is not answering", w.role, w.name, w.address)
        w.healthy = False
        if self.resolve is not None:
            asyncio.get_running_loop().run_in_executor(None, self._refresh, w)

    def _refresh(self, w: WorkerView) -> None:
        try:
            address = self.resolve(w.name)
        except WorkerGone as exc:
            if not w.gone:
                log.error("%s worker %s is gone for good: %s", w.role, w.name, exc)
            w.gone = str(exc)
            return
        except Exception:  # noqa: BLE001 - the actor is restarting; the next poll tries again
            return
        if address and address != w.address:
            log.info("%s worker %s moved to %s", w.role, w.name, address)
            w.address = address

    async def _loop(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:  # noqa: BLE001 - a poll must never end the loop
                log.exception("worker poll failed")
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for ch in self._channels.values():
            await ch.close()
