"""The KV store's gRPC service (grpc.aio), its async factory and its blocking entry point.

``create_server(config)`` returns ``(server, port)`` as grpc's examples do; ``serve(config)``
blocks until SIGTERM/SIGINT; ``BackgroundServer`` runs one in a thread for synchronous callers
(tests, a Ray actor). Status codes: unknown chunk NOT_FOUND; malformed header, shape or dtype
mismatch, layers out of order INVALID_ARGUMENT; a put of a chunk id already stored is acknowledged
(``already_stored``) and writes nothing: chunks are write-once; a layer failing its checksum on the way in, or a
chunk with no good copy left, DATA_LOSS; a chunk over a tier's whole budget RESOURCE_EXHAUSTED; a
chunk evicted or replaced mid-read with no other copy of that version, ABORTED (retry).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import threading
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.hostid import host_id
from services.kvstore import wire
from services.kvstore.chunk import TIER_OF_PB, ChunkMeta, InvalidChunk, LayerData, check_chunk_id, layer_checksum, layer_parts
from services.kvstore.config import StoreConfig
from services.kvstore.memory import keep_freed_memory
from services.kvstore.metrics import StoreMetrics
from services.kvstore.store import ChunkVanished, DataLoss, ResourceExhausted, TieredStore
from services.kvstore.wire import Frame, FramedLayer
from services.rpc import kvstore_pb2 as pb
from services.rpc import kvstore_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVStore"].full_name
GRPC_OPTIONS = [("grpc.max_receive_message_length", 8 << 20), ("grpc.max_send_message_length", 8 << 20)]


class _Stored(Exception):
    """The put names a chunk id the store holds: it is acknowledged without reading or writing its layers."""

    def __init__(self, tiers: tuple[int, ...]) -> None:
        super().__init__("already stored")
        self.tiers = tiers


class _BadPut(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


# what a decode worker may write (and delete) under mutual TLS: a chunk's retrieval indexes, opaque bytes kept beside
# its KV (services/index/chunks.py); a chunk's KV is the prefill workers' alone to write
DECODE_WRITES = "uint8"


class KVStoreServicer(pb_grpc.KVStoreServicer):
    def __init__(self, store: TieredStore, metrics: StoreMetrics, authorize: bool = False, nixl=None) -> None:
        self.store = store
        self.nixl = nixl            # the arena's NIXL agent (nixl_export.ArenaExporter), None: no NIXL reads
        self.metrics = metrics
        self.frame_bytes = store.config.frame_bytes
        self.authorize = authorize          # mutual TLS: callers' roles are known (services/cluster/guard.py)

    def _decode_caller(self, context) -> bool:
        from services.cluster.guard import caller_role

        return self.authorize and caller_role(context) == "decode"

    async def Put(self, request_iterator, context):
        started = time.perf_counter()
        try:
            meta, layers = await self._receive(request_iterator, self._decode_caller(context))
            remaining = context.time_remaining()
            if remaining is not None and remaining <= 0:
                raise _BadPut(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before the put was stored")
            tiers = await self.store.put(meta, layers)
        except _Stored as stored:
            return pb.PutResponse(stored_bytes=0, tiers=stored.tiers, already_stored=True)
        except InvalidChunk as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except ResourceExhausted as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except _BadPut as exc:
            await context.abort(exc.code, str(exc))
        self.metrics.put_seconds.observe(time.perf_counter() - started)
        return pb.PutResponse(stored_bytes=meta.nbytes, tiers=tiers)

    async def _receive(self, request_iterator, decode: bool = False) -> tuple[ChunkMeta, tuple[LayerData, ...]]:
        """Collect a whole put in memory; nothing is stored unless every layer arrives intact.
        A layer that fits one get message is kept as that message (``wire.FramedLayer``), a larger
        one as the frames it arrived in (memoryviews into the received messages). ``decode``: the caller is a decode
        worker, which may store a chunk's retrieval indexes (``DECODE_WRITES``) and nothing else."""
        meta = None
        layers: list[LayerData] = []
        sums: list[int] = []
        parts: list = []
        got = 0
        async for request in request_iterator:
            frame = as_frame(request)
            if meta is None:
                if frame is not None or not request.HasField("header"):
                    raise InvalidChunk("a put must start with a header")
                meta = ChunkMeta.from_proto(request.header, max_bytes=self.store.config.max_chunk_bytes)
                if decode and meta.dtype != DECODE_WRITES:
                    raise _BadPut(grpc.StatusCode.PERMISSION_DENIED, "a decode worker may store a chunk's retrieval "
                                                                    f"indexes ({DECODE_WRITES}), not KV ({meta.dtype})")
                if meta.checksums:
                    raise InvalidChunk("put headers carry no layer checksums: each rides on its layer's last frame")
                self.store.check_admissible(meta.nbytes)
                # write-once: a chunk id is a content hash, so a second put of it is either the same bytes or
                # an attempt to replace what every tenant reads; it is acknowledged, and nothing is written
                held = (await self.store.lookup([meta.chunk_id]))[0]
                if held.tiers:
                    raise _Stored(held.tiers)
                continue
            if frame is None:
                raise InvalidChunk("a second header inside one put")
            index = len(layers)
            if frame.layer_index != index:
                raise InvalidChunk(f"frame for layer {frame.layer_index} out of order: expected layer {index}"
                                   if index < meta.num_layers else f"frame for layer {frame.layer_index} after the last layer")
            got += len(frame.data)
            expected = meta.layer_nbytes(index)
            if got > expected or (frame.end_of_layer and got != expected):
                raise InvalidChunk(f"layer {index}: {got} bytes do not match shapes "
                                   f"{meta.k_shapes[index]}/{meta.v_shapes[index]} of {meta.dtype} ({expected} bytes)")
            received = wire.received_layer(frame) if not parts and expected <= self.frame_bytes else None
            parts.append(frame.data)
            if frame.end_of_layer:
                data = tuple(parts)
                if layer_checksum(data) != frame.checksum:
                    raise _BadPut(grpc.StatusCode.DATA_LOSS, f"layer {index} fails its checksum in transit")
                if received is not None:
                    layers.append(received)     # sent as a get will send it: kept as received, no copy
                else:                           # one copy now into the message that carries it on every get
                    layers.append(wire.frame_layer(index, data, frame.checksum) if expected <= self.frame_bytes else data)
                sums.append(frame.checksum)
                parts, got = [], 0
        if meta is None:
            raise InvalidChunk("empty put: no header")
        if len(layers) != meta.num_layers:
            raise InvalidChunk(f"put ended after {len(layers)} of {meta.num_layers} layers")
        return meta.with_checksums(sums), tuple(layers)

    async def Get(self, request, context):
        started = time.perf_counter()
        try:
            check_chunk_id(request.chunk_id)
        except InvalidChunk as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            session = await self.store.open_read(request.chunk_id)
        except DataLoss as exc:
            await context.abort(grpc.StatusCode.DATA_LOSS, str(exc))
        if session is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"chunk {request.chunk_id} is not stored")
        meta = session.meta
        start = request.layer_start
        stop = request.layer_stop if request.HasField("layer_stop") else meta.num_layers
        if not 0 <= start < stop <= meta.num_layers:
            session.abort()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"layer range [{start}, {stop}) is not within the chunk's {meta.num_layers} layers")
        here = bool(request.local_host) and request.local_host == host_id()
        staged: list | None = None
        if (here or (request.nixl and self.nixl is not None)) and session.tier != pb.TIER_DRAM and start == 0 \
                and stop == meta.num_layers and self.store.arena is not None:
            # a whole chunk from a lower tier, for a caller that reads the DRAM arena itself: staged through it (read,
            # checked, promoted), then read from there; the layers read are streamed if the arena did not take it
            try:
                session, staged = await self._stage(session, request.chunk_id)
            except DataLoss as exc:
                await context.abort(grpc.StatusCode.DATA_LOSS, str(exc))
            except ChunkVanished as exc:
                await context.abort(grpc.StatusCode.ABORTED, str(exc))
        tier = TIER_OF_PB[session.tier]
        local = session.local_file(start, stop) if here and staged is None else None
        remote = None
        if local is None and staged is None and request.nixl and self.nixl is not None:
            place = session.local_file(start, stop, arena_only=True)
            remote = None if place is None else self.nixl.layers(place, [meta.layer_nbytes(i) for i in range(start, stop)])
        yield pb.GetResponse(header=meta.to_proto(start, stop, session.tier))
        if remote is not None:
            # the caller reads the layers from this store's registered memory over NIXL (and checks them)
            try:
                yield pb.GetResponse(nixl=pb.NixlLayers(**remote))
            finally:
                session.abort()
            self.metrics.nixl_gets.inc()
            self.metrics.get_seconds.labels(tier).observe(time.perf_counter() - started)
            return
        if local is not None:
            # the caller shares this host: it reads the layers from the DRAM tier's file itself (and checks them)
            try:
                yield pb.GetResponse(local=_local_layers(local))
            finally:
                session.abort()
            self.metrics.local_gets.inc()
            self.metrics.get_seconds.labels(tier).observe(time.perf_counter() - started)
            return
        finished = False
        try:
            for i in range(start, stop):
                try:
                    data = staged[i] if staged is not None else await session.layer(i, stop)
                except DataLoss as exc:
                    await context.abort(grpc.StatusCode.DATA_LOSS, str(exc))
                except ChunkVanished as exc:
                    await context.abort(grpc.StatusCode.ABORTED, str(exc))
                if isinstance(data, FramedLayer) and data.nbytes <= self.frame_bytes:
                    yield data.message          # stored as sent: no copy in Python
                else:
                    for piece, last in _pieces(data, self.frame_bytes):
                        yield Frame(i, piece, last, meta.checksums[i] if last else 0)
                if i == start:
                    self.metrics.first_layer_seconds.labels(tier).observe(time.perf_counter() - started)
            finished = True
        finally:
            if not finished:
                session.abort()
        await session.finish()
        self.metrics.get_seconds.labels(tier).observe(time.perf_counter() - started)

    async def _stage(self, session, chunk_id: str):
        """Read a lower tier's copy whole (checked), let the session promote it, and open the chunk again: (a session
        on the DRAM tier, None), or (the lower tier's session, its layers) when the DRAM tier did not take it."""
        layers = [await session.layer(i, session.meta.num_layers) for i in range(session.meta.num_layers)]
        await session.finish()      # promotes into the faster tiers that have room
        again = await self.store.open_read(chunk_id)
        if again is not None and again.tier == pb.TIER_DRAM and again.meta == session.meta:
            self.metrics.staged_gets.inc()
            return again, None
        if again is not None:
            again.abort()
        return session, layers

    async def Lookup(self, request, context):
        try:
            for chunk_id in request.chunk_ids:
                check_chunk_id(chunk_id)
        except InvalidChunk as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        found = await self.store.lookup(list(request.chunk_ids))
        here = bool(request.local_host) and request.local_host == host_id()
        out = []
        for loc in found:
            item = pb.ChunkLocation(chunk_id=loc.chunk_id, found=bool(loc.tiers), tiers=loc.tiers, nbytes=loc.nbytes)
            if here and loc.tiers and loc.tiers[0] == pb.TIER_DRAM:
                placed = await self.store.local_place(loc.chunk_id)
                if placed is not None:      # the caller reads it from the arena without a Get
                    meta, place = placed
                    item.local.header.CopyFrom(_dram_header(meta))
                    item.local.layers.CopyFrom(_local_layers(place))
                    self.metrics.local_gets.inc()
            out.append(item)
        arena = self.store.arena if here else None
        return pb.LookupResponse(chunks=out, arena_directory=arena.directory if arena is not None else "")

    async def Delete(self, request, context):
        try:
            check_chunk_id(request.chunk_id)
        except InvalidChunk as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if self._decode_caller(context):
            try:
                session = await self.store.open_read(request.chunk_id)
            except DataLoss:
                session = None          # no good copy left (the bad ones were dropped): nothing a delete could take
            if session is not None:
                dtype = session.meta.dtype
                session.abort()
                if dtype != DECODE_WRITES:
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED, "a decode worker may delete a chunk's "
                                                                         f"retrieval indexes, not KV ({dtype})")
        return pb.DeleteResponse(deleted=await self.store.delete(request.chunk_id))

    async def Stats(self, request, context):
        tiers = []
        for slot in self.store.slots:
            c, r = slot.counters, slot.residency
            tiers.append(pb.TierStats(
                tier=slot.pb_tier, budget_bytes=r.budget if r else 0, resident_bytes=r.used if r else 0,
                chunks=len(r.sizes) if r else 0, hits=c.hits, misses=c.misses, evictions=c.evictions,
                bytes_in=c.bytes_in, bytes_out=c.bytes_out, corrupt_entries=c.corrupt))
        cfg = self.store.config
        return pb.StatsResponse(tiers=tiers, policy=cfg.policy, write_mode=cfg.write_mode)


def as_frame(message) -> Frame | None:
    """The frame of a decoded PutRequest (hand-decoded or, as a fallback, protobuf), else None."""
    if isinstance(message, Frame):
        return message
    if message.HasField("frame"):
        f = message.frame
        return Frame(f.layer_index, f.data, f.end_of_layer, f.checksum)
    return None


def _pieces(data: LayerData, step: int):
    """(memoryview, is_last) slices of at most ``step`` bytes covering a layer, without copying."""
    parts = [memoryview(p).cast("B") for p in layer_parts(data)]
    for n, part in enumerate(parts):
        for off in range(0, part.nbytes, step):
            yield part[off:off + step], n == len(parts) - 1 and off + step >= part.nbytes


def _add_servicer(servicer: KVStoreServicer, server: grpc.aio.Server) -> None:
    """As the generated add_KVStoreServicer_to_server, but the bulk messages of Put and Get are
    (de)serialized by services.kvstore.wire (one copy instead of three; same wire format)."""
    handlers = {
        "Put": grpc.stream_unary_rpc_method_handler(servicer.Put, request_deserializer=wire.decode_put_request,
                                                    response_serializer=pb.PutResponse.SerializeToString),
        "Get": grpc.unary_stream_rpc_method_handler(servicer.Get, request_deserializer=pb.GetRequest.FromString,
                                                    response_serializer=wire.encode_message),
    }
    for name, req, resp in (("Lookup", pb.LookupRequest, pb.LookupResponse), ("Delete", pb.DeleteRequest, pb.DeleteResponse),
                            ("Stats", pb.StatsRequest, pb.StatsResponse)):
        handlers[name] = grpc.unary_unary_rpc_method_handler(getattr(servicer, name), request_deserializer=req.FromString,
                                                             response_serializer=resp.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class KVStoreServer:
    """A started store: the grpc.aio server, the tiered store behind it, health and metrics."""

    def __init__(self, grpc_server: grpc.aio.Server, store: TieredStore, metrics: StoreMetrics,
                 health_servicer: health.aio.HealthServicer, metrics_port: int | None, nixl=None) -> None:
        self.grpc_server = grpc_server
        self.nixl = nixl
        self.store = store
        self.metrics = metrics
        self.health = health_servicer
        self.metrics_port = metrics_port

    async def stop(self, grace: float | None = 2.0) -> None:
        """NOT_SERVING first so balancers drain us, then stop RPCs, flush write-behind, close tiers."""
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.grpc_server.stop(grace)
        if self.nixl is not None:
            self.nixl.close()
        await self.store.close()
        self.metrics.stop_http()

    async def wait_for_termination(self) -> None:
        await self.grpc_server.wait_for_termination()


@functools.lru_cache(maxsize=4096)
def _dram_header(meta: ChunkMeta) -> pb.ChunkHeader:
    """A whole chunk's header as its DRAM place is looked up (kept: a lookup of many chunks builds none twice)."""
    return meta.to_proto(0, meta.num_layers, pb.TIER_DRAM)


def _local_layers(place) -> pb.LocalLayers:
    """A ``tiers.LocalFile`` as the message that tells a caller on this host where to read it."""
    return pb.LocalLayers(path=place.path, offsets=place.offsets, generation=place.generation, header=place.header)


def _nixl_exporter(store: TieredStore):
    """The arena's NIXL agent (``nixl_export.ArenaExporter``), registering each segment as the arena makes it; None,
    said in the log, where there is no arena or NIXL cannot load (callers are then streamed the bytes)."""
    from services.handoff.nixl import NixlUnavailable

    arena = store.arena
    if arena is None:
        log.warning("--nixl: the DRAM tier has no arena (it needs --dram-dir and segments): callers are streamed")
        return None
    try:
        from services.kvstore.nixl_export import ArenaExporter

        exporter = ArenaExporter()
    except NixlUnavailable as exc:
        log.warning("--nixl: NIXL cannot be used (%s): callers are streamed", exc)
        return None
    for seg in arena.segments:
        exporter.add(seg.path, seg.size)
    arena.on_segment = exporter.add
    return exporter


async def create_server(config: StoreConfig, *, host: str = "127.0.0.1", port: int = 0,
                        metrics_port: int | None = None, tls=None) -> tuple[KVStoreServer, int]:
    """Open the tiers, start serving on ``host:port`` (0 picks a free port); returns (server, port).

    ``metrics_port``: serve /metrics over HTTP on that port (0 picks one; None: no HTTP endpoint).
    ``tls``: the store's ``ClusterTLS`` (services/cluster/security.py): serve over mutual TLS, callers
    authorized by role (prefill workers write and delete; decode workers only a chunk's retrieval indexes; workers
    read); None: plain, anyone may call.
    """
    from services.cluster.guard import RoleGuard

    keep_freed_memory()      # the process hosting a store: reuse freed layer buffers (memory.py)
    store = TieredStore(config)
    await store.start()
    metrics = StoreMetrics(store)
    exporter = await asyncio.to_thread(_nixl_exporter, store) if config.nixl else None
    server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=[RoleGuard("KV store", authorize=tls is not None)])
    _add_servicer(KVStoreServicer(store, metrics, authorize=tls is not None, nixl=exporter), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = (server.add_insecure_port(f"{host}:{port}") if tls is None
             else server.add_secure_port(f"{host}:{port}", tls.server_credentials()))
    if bound == 0:
        await store.close()
        raise ValueError(f"cannot listen on {host}:{port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    http_port = metrics.serve_http(metrics_port, host) if metrics_port is not None else None
    return KVStoreServer(server, store, metrics, health_servicer, http_port, exporter), bound


def serve(config: StoreConfig, *, host: str = "127.0.0.1", port: int = 0, metrics_port: int | None = None,
          tls=None) -> None:
    """Serve until SIGTERM or SIGINT, then stop gracefully. Prints the bound address first. ``tls``: the store's
    ClusterTLS (mutual TLS, callers authorized by role), None: plain."""

    async def main() -> None:
        server, bound = await create_server(config, host=host, port=port, metrics_port=metrics_port, tls=tls)
        print(f"kvstore listening on {host}:{bound}" + (f" metrics on :{server.metrics_port}" if server.metrics_port else ""),
              flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop()

    asyncio.run(main())


class BackgroundServer:
    """A store served from a thread with its own event loop, for synchronous callers.

    ``with BackgroundServer(config) as srv: KVStoreClient(srv.address)``. ``run(coro)`` runs a
    coroutine on the server's loop (e.g. to inspect or damage ``srv.server.store`` in tests).
    """

    def __init__(self, config: StoreConfig, *, host: str = "127.0.0.1", port: int = 0,
                 metrics_port: int | None = None, tls=None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstore-server", daemon=True)
        self._thread.start()
        try:
            self.server, self.port = self.run(create_server(config, host=host, port=port, metrics_port=metrics_port,
                                                            tls=tls))
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            raise
        self.address = f"{host}:{self.port}"

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self, grace: float | None = 1.0) -> None:
        if self._thread.is_alive():
            self.run(self.server.stop(grace))
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()

    def __enter__(self) -> "BackgroundServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
