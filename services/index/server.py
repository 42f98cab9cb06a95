"""The retrieval-index service (proto/index.proto): gRPC over an ``IndexSet``, its async factory and a background
runner for synchronous callers (tests, a Ray actor).

Status codes: a malformed request (shapes, sizes, owner name, k, scale, non-finite values) INVALID_ARGUMENT naming
what is wrong; an Offload whose bytes fail the header's checksum or fall short DATA_LOSS; an Offload of an (owner,
layer) already held ALREADY_EXISTS (offloads are write-once: drop first); an Offload naming a chunk whose index is
not held FAILED_PRECONDITION (put it: PutChunkIndex); a chunk index whose bytes are not an intact one DATA_LOSS; a
Search naming an owner not held at the layer NOT_FOUND. A refused call stores nothing and changes nothing held. Builds and searches run on worker threads,
so the event loop keeps answering while one runs. With the cluster's mutual TLS on, only prefill and decode
workers offload and drop, only decode workers search (services/cluster/security.py POLICY).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import zlib

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.index import half
from services.index.build import BuildConfig
from services.index.chunks import ChunkIndexCache
from services.kvstore.chunk import CHUNK_ID_RE as CHUNK_ID     # a chunk index is named by its chunk's store id
from services.index.heads import IndexSet
from services.index.metrics import IndexMetrics
from services.modes import MAX_RETRIEVAL_K
from services.rpc import index_pb2 as pb
from services.rpc import index_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RetrievalIndex"].full_name
GRPC_OPTIONS = [("grpc.max_receive_message_length", 8 << 20), ("grpc.max_send_message_length", 8 << 20)]
OWNER = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MAX_LAYERS = 1024
MAX_HEAD_DIM = 1024
MAX_K = MAX_RETRIEVAL_K
MAX_OFFLOAD_BYTES = 64 << 30   # one (owner, layer): keys, values and training queries
MAX_CHUNK_INDEX_BYTES = 1 << 30


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def as_tensor(arr: np.ndarray) -> pb.Tensor:
    arr = np.ascontiguousarray(arr, dtype="<f4")
    return pb.Tensor(shape=list(arr.shape), data=arr.tobytes())


def from_tensor(t: pb.Tensor, what: str, ndim: int) -> np.ndarray:
    """The float32 array a Tensor message holds; Refused(INVALID_ARGUMENT) naming ``what`` when malformed."""
    shape = tuple(int(s) for s in t.shape)
    if len(shape) != ndim:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{what} must have {ndim} dimensions, got shape {list(shape)}")
    if len(t.data) != 4 * int(np.prod(shape, dtype=np.int64)):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"{what} of shape {list(shape)} needs {4 * int(np.prod(shape))} bytes, got {len(t.data)}")
    # a writable copy (a search's few queries): numba compiles other specializations for read-only arrays (views of
    # the received bytes), which the warm-up does not, and a first search compiling them outlasts its deadline
    arr = np.frombuffer(t.data, dtype="<f4").reshape(shape).copy()
    if not np.isfinite(arr).all():
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{what} holds non-finite values")
    return arr


def check_owner(owner: str) -> None:
    if not OWNER.fullmatch(owner):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"owner must be 1-128 characters of [A-Za-z0-9._:-], got {owner[:40]!r}")


def check_offload_header(h: pb.OffloadHeader) -> tuple[tuple[int, ...], tuple[int, ...], str, tuple[int, ...]]:
    """(kv shape, train shape, kv dtype, lists shape) of a well-formed header, else Refused(INVALID_ARGUMENT)."""
    check_owner(h.owner)
    kv_dtype = h.kv_dtype or half.FLOAT32
    if kv_dtype not in half.DTYPES:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"kv_dtype must be one of {', '.join(half.DTYPES)} (or empty), got {h.kv_dtype[:40]!r}")
    if h.layer >= MAX_LAYERS:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"layer must be below {MAX_LAYERS}, got {h.layer}")
    kv, train = tuple(h.kv_shape), tuple(h.train_shape)
    if len(kv) != 3 or len(train) != 3:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"kv_shape and train_shape must be [Hkv, N, D] and [Hkv, M, D], got {list(kv)} and {list(train)}")
    if kv[0] < 1 or not 1 <= kv[2] <= MAX_HEAD_DIM or train[0] != kv[0] or train[2] != kv[2]:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"kv_shape {list(kv)} and train_shape {list(train)} must share Hkv >= 1 and D in 1..{MAX_HEAD_DIM}")
    for run in h.chunks:
        if not CHUNK_ID.fullmatch(run.chunk_id) or run.length < 1:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"a chunk run needs an id of [A-Za-z0-9._-] (1-200) and a length >= 1, got "
                          f"{run.chunk_id[:40]!r}, {run.length}")
    covered = sum(run.length for run in h.chunks)
    if covered > kv[1]:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"the chunks cover {covered} keys, the offload has {kv[1]}")
    if kv[1] > covered and train[1] < 1 and not h.hold:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "offloaded keys outside the chunks need a training query")
    lists = tuple(h.lists_shape)
    least = max(1, min(kv[1], QUERY_NEIGHBORS))         # the keys a build links a training query to
    most = max(least, min(kv[1], MAX_LIST))
    if lists and (len(lists) != 3 or lists[:2] != train[:2] or not least <= lists[2] <= most):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"lists_shape must be [Hkv, M, P] with Hkv, M of train_shape and P in {least}..{MAX_LIST} (at "
                      f"most N), got {list(lists)}")
    if h.hold and (h.keys_held or train[1] or lists or h.chunks or kv[1] < 1):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      "a hold carries keys and values alone (N >= 1; no keys_held, training queries, lists or chunks)")
    if offload_bytes(kv, train, kv_dtype, lists, h.keys_held) > MAX_OFFLOAD_BYTES:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"an offload is at most {MAX_OFFLOAD_BYTES} bytes")
    return kv, train, kv_dtype, lists


def check_chunk_index_header(h: pb.ChunkIndexHeader) -> int:
    """The bytes a well-formed chunk index header announces, else Refused(INVALID_ARGUMENT)."""
    if not CHUNK_ID.fullmatch(h.chunk_id):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"chunk_id must be 1-200 characters of [A-Za-z0-9._-], got {h.chunk_id[:40]!r}")
    if not 1 <= h.nbytes <= MAX_CHUNK_INDEX_BYTES:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"a chunk index is 1..{MAX_CHUNK_INDEX_BYTES} bytes, got {h.nbytes}")
    return h.nbytes


async def _stream(request_iterator, what: str, size_of) -> tuple:
    """A client stream of one header message, then data parts: (header, their bytes joined). ``size_of(header)``
    checks the header and gives the bytes it announces; INVALID_ARGUMENT for another order or more bytes than
    that, DATA_LOSS for fewer."""
    header, parts, got, want = None, [], 0, 0
    async for msg in request_iterator:
        which = msg.WhichOneof("item")
        if header is None:
            if which != "header":
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{what} starts with its header")
            header = msg.header
            want = size_of(header)
            continue
        if which != "data":
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{what} has one header, then data")
        got += len(msg.data)
        if got > want:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{what} sent more than its {want} bytes")
        parts.append(msg.data)
    if header is None:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{what} starts with its header")
    if got != want:
        raise Refused(grpc.StatusCode.DATA_LOSS, f"{what} ended after {got} of its {want} bytes")
    return header, b"".join(parts)


# the wire's bytes of an element of keys and values, by the header's kv_dtype (training queries: float32)
KV_WIRE = {half.FLOAT32: "<f4", half.BFLOAT16: "<u2"}


# exact lists an offload may carry a training query: at least the build's query_neighbors (or every key), at most this
MAX_LIST = 1024
QUERY_NEIGHBORS = BuildConfig().query_neighbors


def offload_bytes(kv, train, kv_dtype: str = half.FLOAT32, lists=(), keys_held: bool = False) -> int:
    """An offload body's bytes: keys and values (none where ``keys_held``), training queries, lists."""
    item = 0 if keys_held else np.dtype(KV_WIRE[kv_dtype]).itemsize
    return (item * 2 * int(np.prod(kv, dtype=np.int64)) + 4 * int(np.prod(train, dtype=np.int64))
            + (4 * int(np.prod(lists, dtype=np.int64)) if lists else 0))


class IndexServicer(pb_grpc.RetrievalIndexServicer):
    def __init__(self, indexes: IndexSet, metrics: IndexMetrics, chunk_indexes: ChunkIndexCache) -> None:
        self.indexes = indexes
        self.metrics = metrics
        self.chunk_indexes = chunk_indexes
        self._writing: set[tuple[str, int]] = set()   # offloads in flight: a second one of the same key is refused

    async def _refuse(self, context, exc: Refused):
        await context.abort(exc.code, str(exc))

    async def Offload(self, request_iterator, context):
        try:
            header, body = await self._receive(request_iterator)
        except Refused as exc:
            return await self._refuse(context, exc)
        kv, train, kv_dtype, list_shape = check_offload_header(header)
        key = (header.owner, header.layer)
        if key in self._writing or (self.indexes.has(*key) and not header.keys_held):
            return await self._refuse(context, Refused(
                grpc.StatusCode.ALREADY_EXISTS, f"owner {header.owner!r} already has layer {header.layer} offloaded"))
        if header.keys_held:        # the keys and values are those the layer's hold left
            held = self.indexes.held_kv(*key)
            if held is None:
                return await self._refuse(context, Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"owner {header.owner!r} holds no keys at layer {header.layer} to index: hold them first"))
            if held[0].shape != kv:
                return await self._refuse(context, Refused(
                    grpc.StatusCode.INVALID_ARGUMENT, f"kv_shape {list(kv)} is not that of the keys held at layer "
                    f"{header.layer}: {list(held[0].shape)}"))
            keys, values = held
            at = 0
        else:
            wire = np.dtype(KV_WIRE[kv_dtype])
            n_kv = int(np.prod(kv))
            pairs = np.frombuffer(body, dtype=wire, count=2 * n_kv)
            keys, values = pairs[:n_kv].reshape(kv), pairs[n_kv:].reshape(kv)
            at = 2 * n_kv * wire.itemsize
        queries = np.frombuffer(body, dtype="<f4", offset=at, count=int(np.prod(train))).reshape(train)
        lists = (np.frombuffer(body, dtype="<i4", offset=at + queries.nbytes).reshape(list_shape)
                 if list_shape else None)
        if lists is not None and lists.size and (lists.min() < 0 or lists.max() >= kv[1]):
            return await self._refuse(context, Refused(grpc.StatusCode.INVALID_ARGUMENT,
                                                       f"exact lists name keys outside 0..{kv[1] - 1}"))
        if kv_dtype == half.BFLOAT16 and not header.keys_held:   # bfloat16's bits (half.py), as add() takes them
            keys, values = keys.astype(np.uint16, copy=False), values.astype(np.uint16, copy=False)
        finite = half.finite if keys.dtype == half.BITS else (lambda a: bool(np.isfinite(a).all()))
        if not (header.keys_held or finite(keys) and finite(values)) or not np.isfinite(queries).all():
            return await self._refuse(context, Refused(grpc.StatusCode.INVALID_ARGUMENT,
                                                       "keys, values and train queries must be finite"))
        chunks = []
        for run in header.chunks:
            index = self.chunk_indexes.get(run.chunk_id)
            if index is None:
                return await self._refuse(context, Refused(grpc.StatusCode.FAILED_PRECONDITION,
                                                           f"no index held for chunk {run.chunk_id}: put it first"))
            if index.length != run.length or index.num_heads != kv[0] or header.layer >= index.num_layers:
                return await self._refuse(context, Refused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"chunk {run.chunk_id}'s index ({index.length} keys, {index.num_layers} layers x {index.num_heads} "
                    f"heads) does not fit a run of {run.length} keys at layer {header.layer} of {kv[0]} heads"))
            chunks.append((run.chunk_id, index))
        self._writing.add(key)
        try:
            t0 = time.perf_counter()
            try:
                if header.hold:
                    await asyncio.to_thread(self.indexes.hold, header.owner, header.layer, keys, values)
                    graph = 0
                else:
                    graph = await asyncio.to_thread(self.indexes.add, header.owner, header.layer, keys, values,
                                                    queries, chunks, lists)
            except ValueError as exc:       # what the checks above let through and the index set refuses
                return await self._refuse(context, Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
            took = time.perf_counter() - t0
        finally:
            self._writing.discard(key)
        if header.hold:         # the keys count once, when they arrive; a build is one whether or not they were held
            self.metrics.keys_offloaded.inc(kv[0] * kv[1])
            return pb.OffloadReply(keys=kv[0] * kv[1], build_seconds=0.0, index_bytes=0)
        self.metrics.build_seconds.observe(took)
        if not header.keys_held:
            self.metrics.keys_offloaded.inc(kv[0] * kv[1])
        return pb.OffloadReply(keys=kv[0] * kv[1], build_seconds=took, index_bytes=graph)

    async def _receive(self, request_iterator) -> tuple[pb.OffloadHeader, bytes]:
        header, body = await _stream(request_iterator, "an offload",
                                     lambda h: offload_bytes(*check_offload_header(h), h.keys_held))
        if zlib.crc32(body) != header.crc32:
            raise Refused(grpc.StatusCode.DATA_LOSS, "the offload's bytes fail its checksum")
        return header, body

    async def PutChunkIndex(self, request_iterator, context):
        from services.index.chunks import ChunkIndex
        from services.index.format import IndexFormatError

        try:
            header, body = await _stream(request_iterator, "a chunk index", check_chunk_index_header)
            try:
                index = await asyncio.to_thread(ChunkIndex.from_bytes, body)
            except IndexFormatError as exc:
                raise Refused(grpc.StatusCode.DATA_LOSS, f"chunk {header.chunk_id}: {exc}") from None
        except Refused as exc:
            return await self._refuse(context, exc)
        self.chunk_indexes.put(header.chunk_id, index)
        held, nbytes = self.chunk_indexes.held()
        return pb.ChunkIndexReply(length=index.length, layers=index.num_layers, heads=index.num_heads,
                                  chunk_indexes=held, chunk_index_bytes=nbytes)

    async def Search(self, request, context):
        try:
            for owner in request.owners:
                check_owner(owner)
            if not request.owners:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "a search names at least one owner")
            q = from_tensor(request.queries, "queries", 3)
            if q.shape[0] != len(request.owners) or q.shape[1] < 1 or not 1 <= q.shape[2] <= MAX_HEAD_DIM:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                              f"queries must be [B, Hq, D] with B = {len(request.owners)} owners, got {list(q.shape)}")
            if not 1 <= request.k <= MAX_K:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"k must be in 1..{MAX_K}, got {request.k}")
            if not (np.isfinite(request.scale) and request.scale > 0):
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"scale must be positive, got {request.scale}")
            if request.HasField("beam") and request.beam < request.k:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"beam must be at least k ({request.k}), got {request.beam}")
            for owner in request.owners:
                if not self.indexes.has(owner, request.layer):
                    raise Refused(grpc.StatusCode.NOT_FOUND, f"no offloaded K/V for {owner!r} at layer {request.layer}")
            beam = request.beam if request.HasField("beam") else None
            try:
                ans = await asyncio.to_thread(self.indexes.attend, request.layer, list(request.owners), q,
                                              request.k, request.scale, beam)
            except KeyError as exc:       # dropped while the call was on its way
                raise Refused(grpc.StatusCode.NOT_FOUND, str(exc.args[0])) from None
            except ValueError as exc:     # a shape the owner's keys do not have
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        except Refused as exc:
            return await self._refuse(context, exc)
        self.metrics.search_seconds.observe(ans.seconds)
        self.metrics.keys_scanned.inc(int(ans.scanned.sum()))
        return pb.SearchReply(out=as_tensor(ans.out), lse=as_tensor(ans.lse), scanned=ans.scanned.tolist(),
                              seconds=ans.seconds)

    async def Drop(self, request, context):
        try:
            check_owner(request.owner)
        except Refused as exc:
            return await self._refuse(context, exc)
        return pb.DropReply(layers=self.indexes.drop(request.owner))

    async def Status(self, request, context):
        owners, kv, graph = self.indexes.held()
        return pb.IndexStatus(owners=owners, kv_bytes=kv, index_bytes=graph)


class IndexServer:
    """A started index service: the grpc.aio server, the index set behind it, health and metrics."""

    def __init__(self, grpc_server, indexes: IndexSet, metrics: IndexMetrics, health_servicer, metrics_port):
        self.grpc_server, self.indexes, self.metrics = grpc_server, indexes, metrics
        self.health, self.metrics_port = health_servicer, metrics_port

    async def stop(self, grace: float | None = 2.0) -> None:
        """NOT_SERVING first so callers drain, then stop RPCs and the search threads."""
        for name in (SERVICE_NAME, ""):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.grpc_server.stop(grace)
        self.indexes.close()
        self.metrics.stop_http()


async def create_server(*, threads: int = 4, host: str = "127.0.0.1", port: int = 0, metrics_port: int | None = None,
                        tls=None, chunk_index_bytes: int = 4 << 30, host_dtype: str = half.FLOAT32,
                        warm: bool = True) -> tuple[IndexServer, int]:
    """Start serving on ``host:port`` (0 picks a free port); returns (server, port). ``threads``: searches run at once
    (the node's cores for the service); ``tls``: the service's ClusterTLS (mutual TLS, callers authorized by role),
    None: plain, anyone may call. ``chunk_index_bytes``: the chunk indexes held (least recently used out first).
    ``host_dtype``: how it holds offloaded keys and values (``IndexSet(host_dtype=)``), whatever dtype they came in.
    ``warm``: the index's compiled loops for that dtype made ready before it listens (services/index/warm.py: numba
    compiles them with the interpreter lock held, ~60 s on a 2-core machine without its cache, a few seconds with
    it), so that no caller's first offload or search waits for them past its deadline."""
    from services.cluster.guard import RoleGuard

    half.check_dtype("host_dtype", host_dtype)
    if warm:
        from services.index.warm import warm as warm_loops

        t0 = time.perf_counter()
        await asyncio.get_running_loop().run_in_executor(None, warm_loops, [host_dtype])
        log.info("index loops for %s ready in %.1f s", host_dtype, time.perf_counter() - t0)
    indexes = IndexSet(threads, host_dtype=host_dtype)
    chunk_indexes = ChunkIndexCache(chunk_index_bytes)
    metrics = IndexMetrics(indexes, chunk_indexes=chunk_indexes)
    server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=[RoleGuard("retrieval index", authorize=tls is not None)])
    pb_grpc.add_RetrievalIndexServicer_to_server(IndexServicer(indexes, metrics, chunk_indexes), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = (server.add_insecure_port(f"{host}:{port}") if tls is None
             else server.add_secure_port(f"{host}:{port}", tls.server_credentials()))
    if bound == 0:
        indexes.close()
        raise ValueError(f"cannot listen on {host}:{port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    http_port = metrics.serve_http(metrics_port, host) if metrics_port is not None else None
    return IndexServer(server, indexes, metrics, health_servicer, http_port), bound


class BackgroundIndexServer:
    """An index service served from a thread with its own event loop: ``with BackgroundIndexServer() as srv:
    IndexClient(srv.address)``."""

    def __init__(self, *, threads: int = 4, host: str = "127.0.0.1", port: int = 0, metrics_port: int | None = None,
                 tls=None, host_dtype: str = half.FLOAT32, warm: bool = True) -> None:
        from services.cluster.serving import LoopThread

        self._loop = LoopThread("index-server")
        try:
            self.server, self.port = self._loop.run(create_server(threads=threads, host=host, port=port,
                                                                  metrics_port=metrics_port, tls=tls,
                                                                  host_dtype=host_dtype, warm=warm))
        except BaseException:
            self._loop.stop()
            raise
        self.address = f"{host}:{self.port}"

    def stop(self, grace: float | None = 1.0) -> None:
        if self.server is not None:
            self._loop.run(self.server.stop(grace))
            self.server = None
        self._loop.stop()

    def __enter__(self) -> "BackgroundIndexServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
