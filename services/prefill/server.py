"""The prefill worker's gRPC service (grpc.aio) and its async factory.

Engine work runs on one thread (the engine is not thread-safe); the event loop only moves bytes.
The first token is sampled here and streamed back at once; then the hand-off is serialised (off the
engine thread) and pushed to the decode worker the gateway named. A push that fails is answered
ABORTED (the gateway retries with another decode worker), bad input INVALID_ARGUMENT, no KV memory
RESOURCE_EXHAUSTED, a failure of ours INTERNAL with an error id (the cause is in this worker's log).
Health follows the engine thread: when it stops for good the worker says NOT_SERVING and calls
``on_fatal`` (a Ray actor exits then, and Ray starts it again).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from services.cluster.config import EngineSettings, PrefillSettings
from services.cluster.kvio import StoreAccess, StoreReadMetrics
from services.handoff.cuda_ipc import ipc_reaches, placement, process_ipc_slab, same_gpu, share_from_slab
from services.cluster.profiling import ProfileWindow
from services.cluster.sampling import read_decode_policy, read_sampling
from services.cluster.staging import side_stream
from services.cluster.errors import internal
from services.cluster.serving import (StoppedForGood, add_health, advertised_host, bind, channel, make_server,
                                     serve_metrics, set_serving)
from services.handoff.transport import handoff_parts, probe_transport
from services.engine.graphs.warmup import warm_prefill, warm_up
from services.prefill.controller import LoadingController
from services.prefill.engine_loop import EngineLoop
from services.prefill.metrics import PrefillMetrics
from services.prefill.worker import PrefillJob, PrefillWorker
from services.rpc import tessera_pb2 as pb
from services.rpc import tessera_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PrefillWorker"].full_name
# after a zero-copy hand-off (CUDA IPC, NIXL) to a decode worker failed, its hand-offs go by the gRPC stream this long
STREAM_ONLY_S = 60.0


class PrefillServicer(pb_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillWorker, name: str, metrics_url: str,
                 on_fatal: Callable[[BaseException], None] | None = None, cluster_tls=None,
                 handoff_transport: str = "auto", nixl_slab_bytes: int | None = None,
                 ipc_slab_bytes: int | None = None) -> None:
        self.worker = worker
        self.nixl_slab_bytes = nixl_slab_bytes     # PrefillSettings.nixl_slab_bytes (None: nixl.SLAB_BYTES)
        self.ipc_slab_bytes = ipc_slab_bytes       # PrefillSettings.ipc_slab_bytes (None: cuda_ipc.IPC_SLAB_BYTES)
        self.cluster_tls = cluster_tls      # ClusterTLS: decode workers are dialled over mutual TLS
        self.name = name
        self.metrics_url = metrics_url
        self.transport = probe_transport(worker.eng.device, handoff_transport)
        # decode worker address -> until when its hand-offs go by the stream (a zero-copy one to it failed)
        self._stream_only: dict[str, float] = {}
        self._ipc: dict[str, str] = {}     # decode worker address -> "same", "peer" (its GPU opens ours) or ""
        # one engine thread, pipelined by one request (engine_loop.py)
        self.engine = EngineLoop(on_fatal=on_fatal)
        worker.backlog = self.engine.waiting       # the loading controller's floor while requests wait behind
        # hand-offs are serialised here, so the engine thread goes on to the next request meanwhile
        self.io_threads = ThreadPoolExecutor(2, thread_name_prefix="prefill-handoff")
        self.in_flight = 0
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.profile = ProfileWindow(name, "prefill")      # off unless TESSERA_TORCH_PROFILE is set

    async def _on_engine(self, fn):
        return await asyncio.wrap_future(self.engine.call(fn))

    async def _serving(self, context) -> None:
        """UNAVAILABLE at once when the engine thread has stopped (the worker is about to restart)."""
        if not self.engine.alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill worker {self.name} is restarting: "
                                                             "its engine loop stopped")

    def _decode_stub(self, address: str) -> pb_grpc.DecodeWorkerStub:
        if address not in self._channels:
            self._channels[address] = channel(address, "decode", self.cluster_tls)
        return pb_grpc.DecodeWorkerStub(self._channels[address])

    async def Prefill(self, request: pb.PrefillRequest, context):
        """Streams two replies: the first token as soon as it is sampled, then (hand-off delivered) the stats."""
        from services.engine.kv.block_pool import PoolExhausted

        await self._serving(context)
        if not request.decode_address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "decode_address is required")
        try:
            sampling = read_sampling(request.sampling, self.worker.eng.cfg.eos_token_id)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {exc}")
        taps = False
        if request.HasField("decode"):   # what the decode worker would refuse, refused before any pass
            name, params = read_decode_policy(request.decode)
            try:
                taps = self.worker.eng.decode_policy(name, **params).taps_queries
            except (ValueError, TypeError) as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"decode: {exc}")
        # the message's repeated fields as they are: the engine reads each with one numpy conversion (copying
        # them into tuples first cost ~2.5x that)
        job = PrefillJob(request.request_id, tuple(c.ids for c in request.chunks), request.suffix,
                         request.mode or "tessera",
                         request.recompute_ratio if request.HasField("recompute_ratio") else None, sampling,
                         namespaces=tuple(request.chunk_namespaces), tap_queries=taps)
        loop = asyncio.get_running_loop()
        first: asyncio.Future = loop.create_future()

        def on_first(token: int) -> None:   # engine thread
            loop.call_soon_threadsafe(lambda: first.done() or first.set_result(token))

        self.in_flight += 1
        self.worker.metrics.in_flight.inc()
        def begin():
            self.profile.tick()
            finish = self.worker.begin(job, on_first)
            return lambda: (finish(), self.worker.resident_ids())

        work = asyncio.wrap_future(self.engine.prefill(begin))
        try:
            await asyncio.wait((first, work), return_when=asyncio.FIRST_COMPLETED)
            if first.done():
                yield pb.PrefillReply(first_token=first.result())
            try:
                out, resident = await work
            except ValueError as exc:
                self.worker.metrics.requests.labels("invalid").inc()
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except PoolExhausted as exc:
                self.worker.metrics.requests.labels("exhausted").inc()
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            except Exception as exc:  # noqa: BLE001 - ours: an id for the caller, the cause in the log
                self.worker.metrics.requests.labels("internal").inc()
                err = internal(f"prefill worker {self.name} serving request {job.request_id}", exc)
                await context.abort(err.code, err.message)
            if not first.done():       # the pass finished before the loop ran the first-token callback
                first.set_result(out.first_token)
                yield pb.PrefillReply(first_token=out.first_token)
            pushed, handoff_s, transport = 0, 0.0, ""
            if out.finish is None:     # the request goes on: the decode worker needs the hand-off
                t0 = time.perf_counter()
                pushed, transport = await self._push(out, job.request_id, request.decode_address, context)
                handoff_s = time.perf_counter() - t0
                self.worker.metrics.handoff_seconds.observe(handoff_s)
                self.worker.metrics.handoffs.labels(transport).inc()
            self.worker.metrics.requests.labels("ok").inc()
            stats = pb.RequestStats(
                chunk_tokens_by_tier=out.tier_tokens, recomputed_tokens=out.recomputed_tokens,
                prefill_seconds=out.prefill_seconds, load_seconds=out.load_seconds,
                load_wait_seconds=out.load_wait_seconds, loaded_bytes=out.loaded_bytes,
                handoff_bytes=pushed, transport=transport, prefill_worker=self.name,
                recompute_ratio=out.ratio, queue_seconds=out.queue_seconds,
                first_token_seconds=out.first_token_seconds, handoff_seconds=handoff_s,
                chunk_compute_seconds=out.chunk_compute_seconds, forward_seconds=out.forward_seconds)
            yield pb.PrefillReply(stats=stats, resident_chunk_ids=resident, finish_reason=out.finish or "")
        finally:
            self.in_flight -= 1
            self.worker.metrics.in_flight.dec()

    async def _push(self, out, request_id: str, address: str, context) -> tuple[int, str]:
        """Serialise the hand-off (off the engine thread) and stream it to the decode worker; ABORTED
        when that fails (the gateway then tries another decode worker); a zero-copy hand-off the decode worker
        answers DATA_LOSS to goes again by the stream (``STREAM_ONLY_S``). Returns (private and payload
        bytes moved, the transport used): CUDA IPC for the K/V when the decode worker shares this GPU
        ("cuda-ipc") or sees it from another GPU of this host ("cuda-ipc-peer": it copies them GPU to GPU)."""
        loop = asyncio.get_running_loop()
        header = pb.HandoffHeader(request_id=request_id, kind="engine", first_token=out.first_token,
                                  storing=out.storing)
        kv = None               # held until the decode worker has copied it out (its ack)
        used = "grpc"
        zero_copy = time.monotonic() >= self._stream_only.get(address, 0.0)
        ipc = await self._ipc_to(address) if zero_copy and self.transport.name in ("cuda-ipc", "nixl") else ""
        piece = None            # a piece of this worker's CUDA IPC slab: given back once the push is over
        if ipc:
            kv = await loop.run_in_executor(self.io_threads, out.handoff.kv_buffer)
            slab = process_ipc_slab(kv.device, self.ipc_slab_bytes)
            piece, msg = await loop.run_in_executor(self.io_threads, self._after_export, out.handoff,
                                                    lambda: share_from_slab(kv, slab))
            header.kv.CopyFrom(msg)
            used = "cuda-ipc" if ipc == "same" else "cuda-ipc-peer"
        elif zero_copy and self.transport.name == "nixl" and out.handoff.layers:
            kv = await loop.run_in_executor(self.io_threads, self._after_export, out.handoff,
                                            lambda: self._offer_nixl(out.handoff.kv_buffer().contiguous(), header))
            used = "nixl" if kv is not None else "grpc"
        nixl_offered = kv if used == "nixl" else None   # given back once the push is over, however it went

        def whole():        # the hand-off with its K/V, for the stream
            return loop.run_in_executor(self.io_threads, self._after_export, out.handoff, out.handoff.to_bytes)

        def push(payload: bytes):
            return self._decode_stub(address).PushHandoff(handoff_parts(header, payload),
                                                          timeout=max(context.time_remaining() or 30.0, 0.1))

        if kv is not None:
            payload = await loop.run_in_executor(self.io_threads, lambda: out.handoff.to_bytes(with_kv=False))
        else:
            payload = await whole()
        try:
            try:
                await push(payload)
            except grpc.aio.AioRpcError as exc:
                if kv is None or exc.code() != grpc.StatusCode.DATA_LOSS:
                    raise
                # the decode worker could not take the K/V where they are (it cannot open the buffer, the NIXL
                # read failed or arrived damaged): the stream carries them, and for a while every hand-off to it
                log.warning("prefill worker %s: hand-off %s by %s to %s failed (%s); it goes by the gRPC stream, "
                            "and so do this worker's next ones for %.0f s", self.name, request_id, used, address,
                            exc.details(), STREAM_ONLY_S)
                self._stream_only[address] = time.monotonic() + STREAM_ONLY_S
                self.worker.metrics.requests.labels("handoff_fallback").inc()
                header.ClearField("kv")
                header.ClearField("nixl")
                payload = await whole()
                used = "grpc"
                await push(payload)
        except grpc.aio.AioRpcError as exc:
            self.worker.metrics.requests.labels("handoff_failed").inc()
            await context.abort(grpc.StatusCode.ABORTED, f"hand-off to decode worker {address} "
                                                         f"failed: {exc.code().name}: {exc.details()}")
        finally:
            if nixl_offered is not None:     # read and acknowledged (or failed): the memory goes back
                await loop.run_in_executor(self.io_threads, self._nixl_release, nixl_offered)
            if piece is not None:            # copied out and acknowledged (or failed): the piece goes back
                slab.give(piece)
        moved = len(payload) + (kv.numel() * kv.element_size() if kv is not None and used != "grpc" else 0)
        self.worker.metrics.handoff_bytes.inc(moved)
        return moved, used

    @staticmethod
    def _nixl_release(offered) -> None:
        """What an offer named, back: a piece of this worker's NIXL slab, or memory registered for it alone."""
        from services.handoff.nixl import process_endpoint, release

        release(process_endpoint(), offered)

    def _offer_nixl(self, kv, header: pb.HandoffHeader):
        """Offer the hand-off's K/V over this worker's NIXL endpoint and put the offer in the header: from a piece of
        the worker's slab (registered once; the K/V copied in), else registered alone for this hand-off. Returns what
        the offer names (give it back with ``_nixl_release``), or None (logged: the stream carries them) when NIXL
        fails here."""
        from services.handoff.nixl import offer_from_slab, process_endpoint

        try:
            offered, offer = offer_from_slab(process_endpoint(), kv, self.nixl_slab_bytes)
        except Exception as exc:   # noqa: BLE001 - any NIXL failure: this hand-off goes by the stream
            self._nixl_failed(kv.device, exc)
            return None
        header.nixl.CopyFrom(pb.NixlBuffer(offer=offer.to_bytes(), dtype=str(kv.dtype).removeprefix("torch."),
                                           numel=kv.numel()))
        return offered

    def _nixl_failed(self, device, exc: Exception) -> None:
        """NIXL could not offer this worker's memory (say a NIXL whose UCX has no CUDA support for this GPU: it
        cannot register GPU memory at all): this hand-off and every later one go without it, and the transport that
        Stats reports says so and why, instead of naming NIXL while each hand-off fails over to the stream."""
        if self.transport.name != "nixl":
            return
        self.transport = probe_transport(device, nixl_failed=f"it could not offer this worker's memory: {exc}")
        log.error("prefill worker %s: NIXL could not offer a hand-off's K/V (%s): hand-offs go without NIXL from "
                  "now on (%s)", self.name, exc, self.transport.detail)

    def _after_export(self, handoff, fn):
        """fn() (an io thread) on a side stream ordered after the hand-off's gathers only: on the engine's
        stream its device reads (the device-to-host copy, the IPC export's event) would queue behind the
        next request's pass, which the engine thread issues meanwhile."""
        import torch

        ready = getattr(handoff, "ready", None)
        if ready is None:
            return fn()
        side = side_stream(self.worker.eng.device, "handoff")
        with torch.cuda.stream(side):
            side.wait_event(ready)
            return fn()

    async def _ipc_to(self, address: str) -> str:
        """Whether the decode worker at ``address`` runs on this worker's GPU ("same"), can open CUDA IPC buffers of
        it from another GPU of this host ("peer"), or neither (""); asked once per address."""
        if address not in self._ipc:
            try:
                st = await self._decode_stub(address).Status(pb.WorkerStatusRequest(), timeout=5.0)
            except grpc.aio.AioRpcError:
                return ""       # asked again next time
            me = pb.WorkerStatus(**placement(self.worker.eng.device))
            self._ipc[address] = "same" if same_gpu(me, st) else "peer" if ipc_reaches(me, st) else ""
        return self._ipc[address]

    async def Warm(self, request: pb.WarmRequest, context):
        chunks = [list(c.ids) for c in request.chunks]
        namespaces = tuple(request.chunk_namespaces)
        try:
            stored, resident = await self._on_engine(lambda: (self.worker.warm(chunks, namespaces),
                                                              self.worker.resident_ids()))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.WarmReply(stored=stored, resident_chunk_ids=resident)

    async def Status(self, request, context):
        await self._serving(context)
        resident = self.worker.resident          # the snapshot: a poll never waits behind queued prefills
        return pb.WorkerStatus(name=self.name, in_flight=self.in_flight, resident_chunk_ids=resident,
                               transport=self.transport.detail, metrics_url=self.metrics_url,
                               model_fingerprint=self.worker.eng.fingerprint, **placement(self.worker.eng.device))

    async def Reset(self, request, context):
        ids = tuple(request.chunk_ids)
        dropped, _ = await self._on_engine(lambda: (self.worker.reset(request.device_only, ids),
                                                    self.worker.resident_ids()))
        return pb.ResetReply(chunks_dropped=dropped)


class PrefillServer:
    def __init__(self, grpc_server, servicer: PrefillServicer, health, metrics_http) -> None:
        self.grpc_server, self.servicer, self.health, self._http = grpc_server, servicer, health, metrics_http

    async def stop(self, grace: float | None = 1.0) -> None:
        await set_serving(self.health, (SERVICE_NAME,), False)
        await self.grpc_server.stop(grace)
        for ch in self.servicer._channels.values():
            await ch.close()
        if self.servicer.profile.enabled:    # a profiled window the run ended inside of is written
            await asyncio.wait_for(asyncio.wrap_future(self.servicer.engine.call(self.servicer.profile.close)), 60)
        await asyncio.to_thread(self.servicer.engine.stop)
        self.servicer.io_threads.shutdown(wait=False, cancel_futures=True)
        self.servicer.worker.store.close()
        self._http.shutdown()


async def create_server(name: str, engine: EngineSettings, store_addresses: list[str],
                        settings: PrefillSettings | None = None, *, host: str = "127.0.0.1",
                        port: int = 0, on_fatal: Callable[[], None] | None = None,
                        cluster_tls=None) -> tuple[PrefillServer, int]:
    """Load the model, start serving on ``host:port`` (0: any); returns (server, port). ``on_fatal()`` runs
    on the event loop once the engine loop has stopped for good and health says NOT_SERVING. With
    ``cluster_tls`` (a prefill ``ClusterTLS``) it serves, and calls the store and decode workers, over mutual
    TLS, and only the gateway may call it (services/cluster/security.py)."""
    settings = settings or PrefillSettings()
    metrics = PrefillMetrics()
    eng = await asyncio.to_thread(engine.load)
    if settings.warmup_tokens:
        ratios = (0.0, settings.quality_floor if settings.default_ratio is None else settings.default_ratio)
        warm = await warm_up(name, warm_prefill, eng, tuple(dict.fromkeys(ratios)), settings.warmup_tokens)
        if warm and warm["passes"]:
            log.info("prefill worker %s warmed up in %.1f s: %s over %d tokens", name, warm["seconds"],
                     ", ".join(warm["passes"]), warm["context_tokens"])
    store = StoreAccess(store_addresses, on_error=lambda call: metrics.store_errors.labels(call).inc(),
                        host_bytes=settings.host_cache_bytes, tls=cluster_tls,
                        nixl=settings.handoff_transport == "nixl")     # the data plane: stores on other hosts too
    metrics.registry.register(StoreReadMetrics(store, "tessera_prefill"))
    if settings.warmup_tokens and eng.device.type == "cuda" and store_addresses:
        from services.kvstore.client import warm_device_checks

        await asyncio.to_thread(warm_device_checks, eng.device)     # the loads' checksum kernel compiled now
    controller = LoadingController(settings.quality_floor, probe_every=8 if settings.store_loads == "cost" else 1,
                                   loads=settings.store_loads != "never")
    worker = PrefillWorker(eng, store, controller, metrics, settings.default_ratio)
    http, http_port = serve_metrics(metrics.registry, host)
    fatal = StoppedForGood((SERVICE_NAME,), on_fatal)
    servicer = PrefillServicer(worker, name, f"http://{advertised_host(host)}:{http_port}/metrics", on_fatal=fatal,
                               cluster_tls=cluster_tls, handoff_transport=settings.handoff_transport,
                               nixl_slab_bytes=settings.nixl_slab_bytes, ipc_slab_bytes=settings.ipc_slab_bytes)
    server = make_server(f"prefill worker {name}", cluster_tls)
    pb_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
    health = await add_health(server, (SERVICE_NAME,))
    fatal.health = health
    bound = bind(server, host, port, cluster_tls=cluster_tls)
    await server.start()
    await set_serving(health, (SERVICE_NAME,), True)
    log.info("prefill worker %s on %s:%d (%s)", name, host, bound, servicer.transport.detail)
    return PrefillServer(server, servicer, health, http), bound
