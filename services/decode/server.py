"""The decode worker's gRPC service (grpc.aio) and its async factory.

``PushHandoff`` (from a prefill worker) parks a complete hand-off under its request id; ``Decode``
(from the gateway) takes it, hands it to the continuous batcher and streams the tokens as the
engine thread produces them. A Decode whose hand-off never came ends NOT_FOUND; one whose
sequence cannot be rebuilt or decoded ends INTERNAL with an error id (the cause is in this worker's
log), RESOURCE_EXHAUSTED when KV memory ran out. A client that goes away cancels its sequence (freed
at the next step). Health follows the engine thread, not the process: when the batcher stops for good
the worker says NOT_SERVING, fails what it holds and calls ``on_fatal`` (a Ray actor exits then, and
Ray starts it again). Handed its retrieval index service's address, the worker keeps its retrieval
sequences' K/V and indexes there (services/decode/indexes.py), else in its own memory.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from services.cluster.config import DecodeSettings, EngineSettings
from services.cluster.kvio import ChunkIndexStore, StoreAccess, StoreReadMetrics
from services.handoff.cuda_ipc import close_idle_slabs, copy_out, placement
from services.cluster.profiling import ProfileWindow
from services.cluster.sampling import read_decode_policy, read_sampling
from services.cluster.serving import (StoppedForGood, add_health, advertised_host, bind, make_server, serve_metrics,
                                     set_serving)
from services.handoff.transport import HandoffError, ReceivedHandoff, probe_transport, receive_handoff
from services.decode.batcher import Batcher, DecodeJob
from services.decode.indexes import RemoteIndexes
from services.decode.metrics import DecodeMetrics
from services.handoff.prepare import fetch_more, prepare
from services.engine.decode import DecodePolicy, DecodeStats
from services.engine.graphs.warmup import warm_decode, warm_up
from services.rpc import tessera_pb2 as pb
from services.rpc import tessera_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DecodeWorker"].full_name


class DecodeServicer(pb_grpc.DecodeWorkerServicer):
    def __init__(self, batcher: Batcher, engine, store: StoreAccess, metrics: DecodeMetrics, name: str,
                 metrics_url: str, settings: DecodeSettings) -> None:
        self.batcher, self.eng, self.store, self.metrics = batcher, engine, store, metrics
        self.name, self.metrics_url, self.settings = name, metrics_url, settings
        self.transport = probe_transport(engine.device)
        self._nixl_device_ok = True     # NIXL reads hand-offs onto the engine's device until that once fails
        self._pending: dict[str, tuple[ReceivedHandoff, float]] = {}
        self._arrived: dict[str, asyncio.Event] = {}
        self.decoding = 0

    def _event(self, request_id: str) -> asyncio.Event:
        return self._arrived.setdefault(request_id, asyncio.Event())

    def _sweep(self) -> int:
        """Drop hand-offs nobody asked for (their client left, or their gateway call failed): the gateway
        asks for a hand-off as soon as its push is acknowledged, so one parked longer than
        ``handoff_wait_s`` is abandoned. Returns how many were dropped."""
        old = time.monotonic() - self.settings.handoff_wait_s
        stale = [r for r, (_, t) in self._pending.items() if t < old]
        for rid in stale:
            self._pending.pop(rid, None)
            self._arrived.pop(rid, None)
        if stale:
            self.metrics.handoffs_dropped.inc(len(stale))
        return len(stale)

    async def sweep_forever(self) -> None:
        """Sweep on a timer too: a parked hand-off may hold GPU memory (a same-GPU hand-off's K/V)."""
        every = max(0.05, self.settings.handoff_wait_s / 4)
        while True:
            await asyncio.sleep(every)
            self._sweep()
            close_idle_slabs()       # a CUDA IPC slab no hand-off came from lately (its sender may have stopped)

    async def PushHandoff(self, request_iterator, context):
        try:
            received = await receive_handoff(request_iterator)
        except HandoffError as exc:
            await context.abort(grpc.StatusCode.DATA_LOSS, str(exc))
        if received.header.HasField("kv"):
            # the K/V stay on the GPU: copy them out before acknowledging (the sender frees them then)
            try:
                kv = await asyncio.to_thread(copy_out, received.header.kv, self.eng.device)
            except (RuntimeError, ValueError) as exc:
                await context.abort(grpc.StatusCode.DATA_LOSS, f"hand-off {received.header.request_id}: "
                                                               f"cannot open its CUDA IPC buffer: {exc}")
            received = ReceivedHandoff(received.header, received.payload, kv)
        elif received.header.HasField("nixl"):
            # the K/V are in the prefill worker's registered memory: read them over NIXL and check them before
            # acknowledging (the sender deregisters them then)
            try:
                kv = await asyncio.to_thread(self._read_nixl, received.header.nixl)
            except (RuntimeError, ValueError) as exc:
                await context.abort(grpc.StatusCode.DATA_LOSS, f"hand-off {received.header.request_id}: "
                                                               f"its K/V could not be read over NIXL: {exc}")
            received = ReceivedHandoff(received.header, received.payload, kv)
        rid = received.header.request_id
        self._sweep()
        self._pending[rid] = (received, time.monotonic())
        self._event(rid).set()
        self.metrics.handoff_bytes.inc(len(received.payload))
        self.metrics.handoffs.labels(received.header.kind).inc()
        return pb.HandoffAck(received_bytes=len(received.payload))

    def _read_nixl(self, msg: pb.NixlBuffer):
        """The hand-off's K/V read over NIXL onto this worker's device (through its NIXL slab, registered once; into
        memory registered for this read where the slab has no room), checked there. Where NIXL cannot take this
        GPU's memory (a UCX without CUDA), into host memory instead (said once in the log). RuntimeError (the
        caller's DATA_LOSS) when the read fails."""
        import torch

        from services.handoff.nixl import Offer, TransferFailed, process_endpoint, read_via_slab

        dtype = getattr(torch, msg.dtype, None)
        if not isinstance(dtype, torch.dtype) or not msg.numel:
            raise ValueError(f"NIXL buffer of dtype {msg.dtype!r} and {msg.numel} elements")
        offer = Offer.from_bytes(msg.offer)
        device = self.eng.device if self._nixl_device_ok else torch.device("cpu")
        try:
            return read_via_slab(process_endpoint(), offer, dtype, msg.numel, device,
                                 timeout=self.settings.handoff_wait_s, notify=b"read",
                                 slab_bytes=self.settings.nixl_slab_bytes)
        except TransferFailed:
            raise
        except Exception as exc:   # noqa: BLE001 - NIXL's own error types: registering or reading this memory
            if device.type == "cpu":
                raise RuntimeError(f"NIXL read failed: {exc}") from None
            log.warning("decode worker %s: NIXL cannot read into %s memory (%s); hand-offs land in host memory",
                        self.name, device, exc)
            self._nixl_device_ok = False
            return self._read_nixl(msg)

    async def _serving(self, context) -> None:
        """UNAVAILABLE at once when the engine thread has stopped (the worker is about to restart)."""
        if not self.batcher.alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"decode worker {self.name} is restarting: "
                                                             "its engine loop stopped")

    async def Decode(self, request: pb.DecodeRequest, context):
        await self._serving(context)
        rid = request.request_id
        try:
            await asyncio.wait_for(self._event(rid).wait(), self.settings.handoff_wait_s)
        except asyncio.TimeoutError:
            self._arrived.pop(rid, None)
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no hand-off arrived for request {rid}")
        received, _ = self._pending.pop(rid)
        self._arrived.pop(rid, None)
        try:
            name, params = read_decode_policy(request.decode)
            policy = self.eng.decode_policy(name, **params)
        except (ValueError, TypeError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"decode: {exc}")
        # a retrieval decode's chunk indexes come from the store here, off the engine thread
        indexes = self.eng.forward.chunk_index_store if policy.name == "retrieval" else None
        try:
            prepared = await asyncio.to_thread(prepare, received, self.eng, self.store, self.settings.store_wait_s,
                                               indexes)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"hand-off of request {rid}: {exc}")
        for source, n in prepared.sources.items():
            self.metrics.chunks.labels(source).inc(n)
        if prepared.store_wait_s is not None:
            self.metrics.store_wait_seconds.observe(prepared.store_wait_s)
        try:
            sampling = read_sampling(request.sampling, self.eng.cfg.eos_token_id)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {exc}")
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        job = DecodeJob(rid, prepared, sampling,
                        lambda toks, reason, err: loop.call_soon_threadsafe(out.put_nowait, (toks, reason, err)),
                        policy=policy)
        # the caller leaving ends the sequence at the next step; the generator's own clean-up may wait for the
        # garbage collector when the caller leaves while the generator is parked at a yield. The callback holds
        # the event alone: the RPC's context outlives the call until a garbage collection, and a job held there
        # kept its hand-off's K/V on the GPU (a full-mode closed loop grew this worker by ~17 GB and ran the
        # GPU out of memory: bench/cluster/README.md)
        cancelled = job.cancelled
        context.add_done_callback(lambda _ctx: cancelled.set())
        self.decoding += 1
        self.batcher.submit(job)
        try:
            held = None
            while True:
                toks, reason, err, held = coalesce(held if held is not None else await out.get(), out)
                if err is not None:
                    await context.abort(err.code, err.message)
                if reason is None:
                    yield pb.DecodeResponse(token_ids=toks)
                    continue
                # the batcher took the sequence's stats before telling how it ended
                yield pb.DecodeResponse(token_ids=toks, finish_reason=reason, stats=decode_stats(policy, job.stats))
                return
        finally:
            job.cancelled.set()      # no-op once finished; frees the sequence if the caller left
            self.decoding -= 1

    async def Status(self, request, context):
        await self._serving(context)
        resident = self.batcher.resident         # a snapshot: a poll never waits for a decode step
        return pb.WorkerStatus(name=self.name, in_flight=self.decoding, resident_chunk_ids=resident,
                               transport=self.transport.detail, metrics_url=self.metrics_url,
                               model_fingerprint=self.eng.fingerprint, **placement(self.eng.device))

    async def Prefetch(self, request: pb.PrefetchRequest, context):
        ids = list(dict.fromkeys(request.chunk_ids))
        return pb.PrefetchReply(kept=await asyncio.to_thread(self.store.prefetch, ids))

    async def Reset(self, request, context):
        ids = tuple(request.chunk_ids)

        def clear() -> int:
            if ids:                              # a tenant's chunks only (the prefill workers delete stored copies)
                dropped = self.eng.cache.drop(ids)
                if not request.device_only:
                    self.store.forget(ids, store=False)
                return dropped
            before = len(self.eng.cache)
            self.eng.cache.clear()
            if not request.device_only:
                self.store.drop_known()          # empties the host tier (a decode worker stores nothing)
            return before - len(self.eng.cache)
        return pb.ResetReply(chunks_dropped=await asyncio.wrap_future(self.batcher.call(clear)))


def coalesce(first: tuple, out: asyncio.Queue) -> tuple[list[int], str | None, object, tuple | None]:
    """``first`` (tokens, finish reason, error) and the token items queued behind it as one message: when the event
    loop falls behind the decode steps, a stream sends what has piled up at once rather than a message a token (less
    work on the loop, which shares the interpreter lock with the engine thread). Stops at an item that ends the
    stream or fails it: the tokens before it are sent first, and it is returned as ``held`` for the next message.
    -> (tokens, reason, error, held)."""
    toks, reason, err = first
    if reason is not None or err is not None:
        return list(toks), reason, err, None
    toks = list(toks)
    while not out.empty():
        item = out.get_nowait()
        if item[2] is not None:            # a failure: the tokens so far go first
            return toks, None, None, item
        toks += item[0]
        if item[1] is not None:            # the last tokens, with how the stream ended
            return toks, item[1], None, None
    return toks, None, None, None


def decode_stats(policy: DecodePolicy, stats: DecodeStats | None) -> pb.DecodeStats:
    """A request's policy and what its steps read, as the gateway relays them to the client."""
    out = pb.DecodeStats(policy=policy.name)
    if stats is not None:
        out.steps, out.pages_visible, out.pages_read = stats.steps, stats.pages_visible, stats.pages_read
        out.pages_corrected = stats.pages_corrected
        out.keys_scanned, out.retrieval_seconds = stats.keys_scanned, stats.retrieval_seconds
    return out


class DecodeServer:
    def __init__(self, grpc_server, servicer: DecodeServicer, health, metrics_http,
                 restagers: ThreadPoolExecutor) -> None:
        self.grpc_server, self.servicer, self.health, self._http = grpc_server, servicer, health, metrics_http
        self.restagers = restagers          # the helpers reading chunks for hand-offs the batcher sent back
        self._sweeper = asyncio.ensure_future(servicer.sweep_forever())

    async def stop(self, grace: float | None = 1.0) -> None:
        self._sweeper.cancel()
        await set_serving(self.health, (SERVICE_NAME,), False)
        await self.grpc_server.stop(grace)
        profile = self.servicer.batcher.profile
        if profile is not None and profile.enabled:    # a profiled window the run ended inside of is written
            await asyncio.wait_for(asyncio.wrap_future(self.servicer.batcher.call(profile.close)), 60)
        await asyncio.to_thread(self.servicer.batcher.stop)
        await asyncio.to_thread(self.restagers.shutdown)      # jobs it hands back now are failed by the stopped batcher
        self.servicer.store.close()
        if isinstance(self.servicer.eng.forward.indexes, RemoteIndexes):
            self.servicer.eng.forward.indexes.close()
        self._http.shutdown()


async def create_server(name: str, engine: EngineSettings, store_addresses: list[str],
                        settings: DecodeSettings | None = None, *, host: str = "127.0.0.1",
                        port: int = 0, on_fatal: Callable[[], None] | None = None,
                        cluster_tls=None, index_address: str | None = None) -> tuple[DecodeServer, int]:
    """Load the model, start the batcher and serve on ``host:port`` (0: any); returns (server, port).
    ``on_fatal()`` runs on the event loop once the engine loop has stopped for good and health says
    NOT_SERVING (a Ray actor exits there, to be restarted). With ``cluster_tls`` (a decode ``ClusterTLS``)
    it serves, and reads the store, over mutual TLS: the gateway may call it, prefill workers push
    hand-offs (services/cluster/security.py). ``index_address``: its retrieval index service (the cluster's
    index role, on this node), which holds what retrieval decode offloads; None: the engine's own index set."""
    settings = settings or DecodeSettings()
    metrics = DecodeMetrics()
    eng = await asyncio.to_thread(engine.load)
    if index_address is not None:
        from services.index.client import IndexClient   # numba loads with it

        # before the warm-up and the first request: the engine makes its own index set only when it has none
        client = IndexClient(index_address, timeout=settings.index_search_timeout_s,
                             offload_timeout=settings.index_offload_timeout_s, tls=cluster_tls,
                             host_dtype=eng.forward.options.index_host_dtype)
        eng.forward.indexes = RemoteIndexes(client)
    if settings.warmup_tokens:
        sparse = None if settings.warmup_sparse else []       # None: Quest's and Retro's defaults
        warm = await warm_up(name, functools.partial(warm_decode, sparse=sparse), eng, settings.max_batch,
                             settings.warmup_tokens)
        if warm and warm["batches"]:
            log.info("decode worker %s warmed up in %.1f s: batches %s over %d tokens", name, warm["seconds"],
                     warm["batches"], warm["context_tokens"])
    store = StoreAccess(store_addresses, on_error=lambda call: metrics.store_errors.labels(call).inc(),
                        host_bytes=settings.host_cache_bytes, tls=cluster_tls)
    metrics.registry.register(StoreReadMetrics(store, "tessera_decode"))
    # chunks' retrieval indexes kept beside their KV, built once for every decode worker (under the cluster's mutual
    # TLS the store takes these, and only these, from decode workers: README, security model)
    if store_addresses:
        eng.forward.chunk_index_store = ChunkIndexStore(store)

    # a chunk evicted between a hand-off's preparation and its admission: asked for now, read onto the GPU and
    # checked there when this host's store arena holds it (as the preparation reads), else streamed
    device = eng.device if eng.device.type == "cuda" else None

    def fetch(cid: str):
        metrics.admission_reads.inc()
        return store.fetcher(store.lookup([cid]), device)(cid)

    # ... unless the batcher sends the hand-off back to have them read here first, off the engine thread
    restagers = ThreadPoolExecutor(2, thread_name_prefix="decode-restage")

    def restage(job: DecodeJob, chunk_ids: list[str]) -> None:
        def read_then_requeue() -> None:
            try:
                fetch_more(job.handoff, chunk_ids, eng, store)
            except Exception as exc:  # noqa: BLE001 - the import reads or computes them at admission instead
                log.warning("decode worker %s: reading chunks again for %s failed: %s", name, job.request_id, exc)
            batcher.submit(job)
        restagers.submit(read_then_requeue)

    fatal = StoppedForGood((SERVICE_NAME,), on_fatal)
    batcher = Batcher(eng, metrics, settings.max_batch, fetch if store.enabled else None,
                      admit_budget_s=settings.admit_budget_s, profile=ProfileWindow(name, "decode"),
                      min_step_interval_s=settings.min_step_interval_s, on_fatal=fatal,
                      admit_during_step=settings.admit_during_step,
                      name=f"decode worker {name}", restage=restage if store.enabled else None)
    http, http_port = serve_metrics(metrics.registry, host)
    servicer = DecodeServicer(batcher, eng, store, metrics, name, f"http://{advertised_host(host)}:{http_port}/metrics", settings)
    server = make_server(f"decode worker {name}", cluster_tls)
    pb_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    health = await add_health(server, (SERVICE_NAME,))
    fatal.health = health
    bound = bind(server, host, port, cluster_tls=cluster_tls)
    await server.start()
    await set_serving(health, (SERVICE_NAME,), True)
    log.info("decode worker %s on %s:%d", name, host, bound)
    return DecodeServer(server, servicer, health, http, restagers), bound
