"""Synchronous client of one store shard: torch tensors in, torch tensors out, byte for byte.

A layer travels as the raw bytes of K then V (bf16 included: tensors are moved as uint8 views),
with a crc32 of the layer: on put, a layer of up to ``frame_bytes`` (3 MiB) goes in one message
laid out as the store keeps it (``wire.frame_layer``; one copy here, none in the store's Python),
a larger one in ``frame_bytes`` pieces. ``get`` yields each layer as
soon as its last frame arrived and passed the checksum, so a caller computes on layer i while later
layers are still on the wire; a layer the store sent as one message is yielded as tensors over that
message's bytes, without a copy (K and V of a layer share one buffer, as before). Every call
carries a deadline (``timeout`` seconds; the client default unless given per call). Server errors
surface as ``grpc.RpcError`` with the status code.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from services.hostid import host_id
from services.kvstore import wire
from services.kvstore.chunk import TIER_OF_PB, ChunkMeta, InvalidChunk, check_chunk_id, checksum, layer_checksum
from services.kvstore.segments import SharedSegments
from services.rpc import kvstore_pb2 as pb
from services.rpc import kvstore_pb2_grpc as pb_grpc
from services.tiers import Tier

TORCH_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.uint8: "uint8"}
_FROM_NAME = {v: k for k, v in TORCH_DTYPES.items()}
_DTYPE_PB = {"float32": pb.DTYPE_FLOAT32, "float16": pb.DTYPE_FLOAT16, "bfloat16": pb.DTYPE_BFLOAT16,
             "uint8": pb.DTYPE_UINT8}
SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"].full_name

# A received message is a ``bytes`` object that only this client references, so a layer that came
# whole is handed out as tensors over it (no copy). torch warns, once per process, that the buffer
# is read-only; writing through the tensors is fine here (nothing else sees those bytes), so that
# one-time warning is taken at import instead of surfacing in the caller's first get.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    torch.frombuffer(b"\0", dtype=torch.uint8)

LOCAL_READ_AHEAD = 4      # layers of a shared-memory file read at once (a layer of an 8B chunk: 2 MiB)
# a read of the store's arena hands on no view later than this after it began: the store reuses a freed extent only
# after its grace (arena.REUSE_GRACE_S, 5 s), so the copies a layer's user makes at once read what was checked (a
# read onto a GPU checks the bytes that landed and needs no window). The grace is short because resting room is room
# the arena cannot use: under churn, chunks that find none are kept as files of their own, the slower path
ARENA_READ_WINDOW_S = 2.0
ARENA_CHECKERS = 8        # threads checking an arena read's layers (~11 GB/s each on an H100 host; 8: 64 MiB in ~1.7 ms)
ARENA_GROUP = 8           # layers of an arena read onto a GPU copied and checked there at once
# how a get's bytes came: this host's store arena copied onto the GPU and checked there, its views checked on the CPU,
# a file of this host's tier read into (pinned) memory, another host's store arena read over NIXL, or the gRPC stream
READ_PATHS = ("arena-device", "arena", "file", "nixl", "stream")
# why a read of this host's tier (or over NIXL) went on by the stream: its file gone, its extent moved, a layer damaged
FALLBACKS = ("gone", "moved", "damaged")

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 8 << 20), ("grpc.max_send_message_length", 8 << 20)]


def warm_device_checks(device) -> None:
    """Compile the checksum kernel that arena reads onto ``device`` (a CUDA device) use, before any read needs it (a
    first compile takes about a second, which a load would otherwise pay)."""
    from kernels.checksum import crc32_spans

    data = torch.zeros(4096, dtype=torch.uint8, device=device)
    if (crc32_spans(data, [0], [4096], backend="triton").item() & 0xFFFFFFFF) != checksum(bytes(4096)):
        raise RuntimeError(f"the checksum kernel is wrong on {device}")


class ChunkCorruptError(RuntimeError):
    """Bytes received from the store do not match the chunk's header or checksums."""


class _LocalGone(Exception):
    """The shared-memory file a store named is gone (its chunk evicted or replaced since): read it by the stream."""


class _LocalDamaged(Exception):
    """Layer ``index`` of a store's shared-memory file failed its check (nothing from it on was handed out): the
    layers [index, stop) are read again by the stream, where the store checks its copy, drops a damaged one and
    serves a good one from a lower tier if it holds one."""

    def __init__(self, index: int, stop: int, checksums: tuple, why: str) -> None:
        super().__init__(why)
        self.index, self.stop, self.checksums = index, stop, checksums


class _LocalMoved(_LocalDamaged):
    """The arena extent a store named holds another chunk now, or the read outlasted its window: the layers
    [index, stop) by the stream (nothing is damaged)."""


class _DeviceIssue:
    """A chunk's layers from an arena segment onto a device, in groups (``_groups``): every group's copy queued first
    (back to back on the device's landing stream, whatever the host then takes to queue the checks), then each
    group's CRC-32 launch (on a stream of its own, after its group's copy; ``kernels.checksum.crc0_spans``, finished
    on the host), then the layers' views, made while the copies run; the current stream waits for the copies before
    its later work reads them. ``check(g)`` waits for group g's check and raises unless its bytes landed, each
    layer's CRC-32 over the landed bytes is the header's, and the extent's header still holds the generation the
    store named: the store writes that header before it reuses the room, so what landed is what was checked.

    NOTE: the copies land in memory of their own, so they need not wait for anything the caller's stream has queued,
    and its caller waits on the host for their checks (``verify``) before using a layer. On the current stream they
    queued behind that stream's work: a prefill worker's chunk loads (services/engine/kv/loader.py) begin the next
    request's pass while the one ahead still runs, and its engine thread then waited for that pass to finish before
    it could issue the next one, which can leave the GPU idle between them (the gain is not yet measured)."""

    def __init__(self, client: "KVStoreClient", meta: ChunkMeta, dtype, stop: int, local, seg, spans, device) -> None:
        from kernels.checksum import crc0_spans

        self.meta, self.stop, self.local, self.seg = meta, stop, local, seg
        cuda = device.type == "cuda"
        checking = landing = None
        if cuda:
            checking = client._check_streams.get(device) or client._check_streams.setdefault(
                device, torch.cuda.Stream(device))
            landing = client._land_streams.get(device) or client._land_streams.setdefault(
                device, torch.cuda.Stream(device))
        self.groups = _groups(spans)
        landed, copied = [], []
        with torch.cuda.stream(landing) if cuda else contextlib.nullcontext():
            for group in self.groups:
                data = seg.bytes[group[0][1]:group[-1][1] + group[-1][2]].to(device, non_blocking=True)
                if cuda:
                    copied.append(torch.cuda.Event())
                    copied[-1].record(landing)
                else:                               # the device's own memory, as a GPU's would be
                    data = data.clone()
                landed.append(data)
        if cuda:        # the caller's stream reads the landed bytes after their copies (and keeps them until it has)
            consumer = torch.cuda.current_stream(device)
            consumer.wait_event(copied[-1])
            for data in landed:
                data.record_stream(consumer)
        self.checks = []
        for i, (group, data) in enumerate(zip(self.groups, landed)):
            lo = group[0][1]
            starts, lengths = [offset - lo for _, offset, _ in group], [n for _, _, n in group]
            if not cuda:
                self.checks.append((crc0_spans(data, starts, lengths, backend="torch"), None))
                continue
            with torch.cuda.stream(checking):
                checking.wait_event(copied[i])
                data.record_stream(checking)
                crc0 = crc0_spans(data, starts, lengths, backend="triton").to("cpu", non_blocking=True)
                done = torch.cuda.Event()
                done.record(checking)
            self.checks.append((crc0, done))
        self.views = [_group_views(data, group, meta, dtype) for group, data in zip(self.groups, landed)]

    def check(self, g: int) -> None:
        from kernels.checksum import crc32_of_crc0

        group, (crc0, done), meta = self.groups[g], self.checks[g], self.meta
        if done is not None:
            done.synchronize()
        if self.seg.header(self.local.header) != self.local.generation:
            raise _LocalMoved(group[0][0], self.stop, tuple(meta.checksums), "the extent moved on")
        for (index, _, _), crc in zip(group, crc32_of_crc0(crc0.tolist(), [n for _, _, n in group])):
            if crc != meta.checksums[index]:
                raise _LocalDamaged(index, self.stop, tuple(meta.checksums),
                                    f"chunk {meta.chunk_id} layer {index}: checksum mismatch of the bytes landed from "
                                    "the store's arena")


class DeviceRead:
    """``KVStoreClient.device_read``: a chunk's layers onto a device, iterated at once (``local``: they land within
    milliseconds), checked by ``verify()``."""

    local = True

    def __init__(self, client: "KVStoreClient", meta: ChunkMeta, dtype, local, seg, spans, device) -> None:
        self._client, self._args = client, (meta, dtype, meta.num_layers, local, seg, spans, device)
        self.chunk_id = meta.chunk_id
        self._issued: _DeviceIssue | None = None
        self._verified = False

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        if self._issued is not None:
            raise RuntimeError(f"chunk {self.chunk_id}: a device read is iterated once")
        client = self._client
        self._issued = _DeviceIssue(client, *self._args)
        client.local_reads += 1
        client.arena_reads += 1
        client.reads["arena-device"] += 1
        for views in self._issued.views:
            yield from views

    def verify(self) -> None:
        """Wait for every group's check; ChunkCorruptError (counted as a fallback: the chunk is recomputed, and its
        next read goes by a Get) unless every layer landed as the store wrote it."""
        if self._verified:
            return
        if self._issued is None:
            raise RuntimeError(f"chunk {self.chunk_id}: verify() before the read was issued")
        try:
            for g in range(len(self._issued.groups)):
                self._issued.check(g)
        except _LocalDamaged as exc:
            client = self._client
            client._fell_back(exc)
            with client._lock:
                client._refused.add(self.chunk_id)
            raise ChunkCorruptError(str(exc)) from None
        self._verified = True


@dataclass(frozen=True, slots=True)
class PutResult:
    chunk_id: str
    nbytes: int
    tiers: tuple[Tier, ...]     # tiers holding the chunk at acknowledgement, fastest first
    already_stored: bool = False  # the id was stored already: the store kept its copy, wrote nothing


@dataclass(frozen=True, slots=True)
class ChunkLocation:
    chunk_id: str
    found: bool
    tiers: tuple[Tier, ...]     # fastest first
    nbytes: int                 # K and V bytes over all layers
    # for a ``local`` client: the chunk's place in its store's shared-memory arena (pb.LocalChunk), for ``get(place=)``
    place: pb.LocalChunk | None = None


def _place_meta(chunk_id: str, place) -> ChunkMeta:
    """A looked-up place's chunk metadata, checked to be this chunk's with an arena extent (ChunkCorruptError)."""
    try:
        meta = _placed_meta(place.header.SerializeToString())
    except InvalidChunk as exc:
        raise ChunkCorruptError(f"chunk {chunk_id}: bad header in its place: {exc}") from None
    if meta.chunk_id != chunk_id or len(meta.checksums) != meta.num_layers or not place.layers.generation:
        raise ChunkCorruptError(f"chunk {chunk_id}: its place names {meta.chunk_id} or no arena extent")
    return meta


@functools.lru_cache(maxsize=4096)
def _placed_meta(header: bytes) -> ChunkMeta:
    """A looked-up place's chunk header, checked (``ChunkMeta.from_proto``); kept by its bytes, as a chunk's header is
    the same at every lookup while the store keeps that version."""
    return ChunkMeta.from_proto(pb.ChunkHeader.FromString(header))


def _group_views(data: torch.Tensor, group: list, meta: ChunkMeta, dtype) -> list[tuple]:
    """(index, K, V) views of a group's layers (``group``: their (index, offset, nbytes) spans) in ``data`` (uint8, the
    group's bytes from its first span on). Layers of one shape lying equally spaced, as a chunk's do in the arena,
    are cut from two strided views over all of them (five torch calls a group); others three calls a tensor. Each call
    gives up the interpreter lock and may wait to get it back: these views are made on a decode worker's helper threads
    beside its engine thread (bench/cluster/README.md, 2026-11-28: 27% of a decode worker's lock samples)."""
    lo, (first, _, size) = group[0][1], group[0]
    ks, vs, kn, item = meta.k_shapes[first], meta.v_shapes[first], meta.k_nbytes(first), dtype.itemsize
    step = group[1][1] - lo if len(group) > 1 else size
    if (len(group) > 1 and step % item == 0 and kn % item == 0 and data.numel() % item == 0
            and data.storage_offset() % item == 0
            and all(meta.k_shapes[i] == ks and meta.v_shapes[i] == vs and off - lo == j * step and n == size
                    for j, (i, off, n) in enumerate(group))):
        flat = data.view(dtype)
        base = flat.storage_offset()
        k_all = flat.as_strided((len(group), *ks), (step // item, *_strides(ks)), base)
        v_all = flat.as_strided((len(group), *vs), (step // item, *_strides(vs)), base + kn // item)
        return [(index, k, v) for (index, _, _), k, v in zip(group, k_all.unbind(0), v_all.unbind(0))]
    out = []
    for index, offset, nbytes in group:
        at, kn = offset - lo, meta.k_nbytes(index)
        out.append((index, data[at:at + kn].view(dtype).reshape(meta.k_shapes[index]),
                    data[at + kn:at + nbytes].view(dtype).reshape(meta.v_shapes[index])))
    return out


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A contiguous tensor's strides (in elements) for ``shape``."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def _groups(spans: list) -> list[list]:
    """An arena read's layers in the groups copied and checked at once: ``ARENA_GROUP`` at a time, the last of them
    halved down to two layers (8, 8, 8, 4, 2, 2 of 32), so that little is left to check after the last copy lands."""
    out, at = [], 0
    while len(spans) - at > ARENA_GROUP:
        out.append(spans[at:at + ARENA_GROUP])
        at += ARENA_GROUP
    while len(spans) - at > 2:
        size = (len(spans) - at + 1) // 2
        out.append(spans[at:at + size])
        at += size
    if at < len(spans):
        out.append(spans[at:])
    return out


def _layer_tensor(parts: list, nbytes: int) -> torch.Tensor:
    """A uint8 tensor of a layer's K||V bytes. A layer that came whole in one message is viewed in
    place (the store aligns its payload, wire.FramedLayer): no copy. Otherwise one copy."""
    if len(parts) == 1:
        buf = torch.frombuffer(parts[0], dtype=torch.uint8)
        if buf.data_ptr() % wire.ALIGN == 0:
            return buf
    buf = torch.empty(nbytes, dtype=torch.uint8)
    view, pos = buf.numpy(), 0
    for part in parts:
        n = len(part)
        view[pos:pos + n] = np.frombuffer(part, dtype=np.uint8)
        pos += n
    return buf


def _raw(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 view of a tensor's bytes (copies only if not on CPU or not contiguous)."""
    return t.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1).numpy()


class KVStoreClient:
    """One store shard at ``address`` ("host:port").

    ``timeout``: default deadline of every call, seconds. ``frame_bytes``: largest payload of a put
    message; a layer up to that size travels whole, in the message the store keeps and serves as it is.
    ``verify``: check each received layer's crc32 end to end (the server checks every tier read
    regardless; turning this off saves the client ~a third of its CPU per byte). ``tls``: this caller's
    ``ClusterTLS`` (services/cluster/security.py): the store is reached over mutual TLS and must prove
    its role; None: a plain channel (a store started without the cluster's certificates). ``local``: on the
    store's host, read layers of its shared-memory DRAM tier from its files (``LocalLayers``), into pinned host
    memory with ``pin`` (a GPU's worker: the copy to the device then runs at full speed); always checked.
    """

    check_on = ("cuda",)    # devices an arena read copies to and checks there (the tests add "cpu": the same path, the twin)

    def __init__(self, address: str, *, timeout: float = 30.0, frame_bytes: int = 3 << 20, verify: bool = True,
                 tls=None, local: bool = False, pin: bool = False, nixl: bool = False) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        if not 4096 <= frame_bytes <= 3 << 20:
            raise ValueError(f"frame_bytes must be within [4096, 3 MiB], got {frame_bytes}")
        self.address = address
        self.timeout = timeout
        self.frame_bytes = frame_bytes
        self.verify = verify
        self.local, self.pin = local, pin
        self.local_reads = 0        # gets answered with a shared-memory file, read here
        self.local_damaged = 0      # of those, reads that found a damaged layer and went on by the stream
        self.arena_reads = 0        # of those, reads from the store's arena (zero-copy views of its segments)
        # reads by how their bytes came (READ_PATHS), and reads of this host's tier that went on by the stream, by why
        self.reads = dict.fromkeys(READ_PATHS, 0)
        self.fallbacks = dict.fromkeys(FALLBACKS, 0)
        self._readers: ThreadPoolExecutor | None = None
        self._checkers: ThreadPoolExecutor | None = None
        self._check_streams: dict = {}      # per CUDA device: the stream arena reads check landed bytes on
        self._land_streams: dict = {}       # per CUDA device: the stream arena reads' copies land on
        self._lock = threading.Lock()
        self._refused: set[str] = set()     # chunks whose last device_read failed its checks: next read by a Get
        # NIXL reads of a store's arena (another host's): this process's endpoint, made at the first get; the reason
        # when NIXL cannot be used here (the gets are then streamed)
        self.nixl, self.nixl_unavailable = nixl, ""
        self._nixl_lock = threading.Lock()
        self._nixl_buf: torch.Tensor | None = None
        self.segments = SharedSegments(pin)
        self._channel = (grpc.insecure_channel(address, options=CHANNEL_OPTIONS) if tls is None else
                         grpc.secure_channel(address, tls.channel_credentials(),
                                             options=[*CHANNEL_OPTIONS, *tls.channel_options("store")]))
        self._stub = pb_grpc.KVStoreStub(self._channel)
        # Bulk RPCs with hand-rolled frame (de)serialization (services.kvstore.wire): same wire format.
        self._put = self._channel.stream_unary(f"/{SERVICE}/Put", request_serializer=wire.encode_message,
                                               response_deserializer=pb.PutResponse.FromString, _registered_method=True)
        self._get = self._channel.unary_stream(f"/{SERVICE}/Get", request_serializer=pb.GetRequest.SerializeToString,
                                               response_deserializer=wire.decode_get_response, _registered_method=True)

    def put(self, chunk_id: str, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], *,
            model_fingerprint: str = "", timeout: float | None = None) -> PutResult:
        """Store ``layers[i] = (k_i, v_i)``; returns once the store acknowledged the whole chunk."""
        header = self._header(chunk_id, layers, model_fingerprint)
        resp = self._put(self._put_requests(header, layers), timeout=timeout or self.timeout)
        return PutResult(chunk_id, resp.stored_bytes, tuple(TIER_OF_PB[t] for t in resp.tiers), resp.already_stored)

    @staticmethod
    def _header(chunk_id: str, layers, model_fingerprint: str) -> pb.ChunkHeader:
        try:
            check_chunk_id(chunk_id)
        except InvalidChunk as exc:
            raise ValueError(str(exc)) from None
        if not layers:
            raise ValueError("a chunk needs at least one layer")
        dtype = layers[0][0].dtype
        if dtype not in TORCH_DTYPES:
            raise ValueError(f"unsupported dtype {dtype}; expected one of {list(TORCH_DTYPES)}")
        shapes = []
        for i, pair in enumerate(layers):
            if len(pair) != 2:
                raise ValueError(f"layer {i} must be a (k, v) pair")
            k, v = pair
            if k.dtype != dtype or v.dtype != dtype:
                raise ValueError(f"layer {i}: dtypes {k.dtype}/{v.dtype} differ from layer 0's {dtype}")
            shapes.append(pb.LayerShape(k_shape=k.shape, v_shape=v.shape))
        return pb.ChunkHeader(chunk_id=chunk_id, model_fingerprint=model_fingerprint, num_layers=len(layers),
                              dtype=_DTYPE_PB[TORCH_DTYPES[dtype]], layers=shapes, checksum_algorithm=pb.CHECKSUM_CRC32)

    def _put_requests(self, header: pb.ChunkHeader, layers) -> Iterator[pb.PutRequest | wire.Frame | bytes]:
        yield pb.PutRequest(header=header)
        step = self.frame_bytes
        for i, (k, v) in enumerate(layers):
            parts = [memoryview(_raw(k)), memoryview(_raw(v))]
            crc = checksum(parts[1], checksum(parts[0]))
            if parts[0].nbytes + parts[1].nbytes <= step:
                # one message, laid out as the store keeps a layer and a get sends it back (the
                # payload aligned): the store keeps the received bytes as they are
                yield wire.frame_layer(i, parts, crc).message
                continue
            for p, part in enumerate(parts):
                for off in range(0, part.nbytes, step):
                    last = p == 1 and off + step >= part.nbytes
                    yield wire.Frame(i, part[off:off + step], last, crc if last else 0)

    def put_bytes(self, entry_id: str, data: bytes, *, model_fingerprint: str = "",
                  timeout: float | None = None) -> PutResult:
        """Store opaque bytes (what a chunk keeps beside its KV: its retrieval indexes, under their own id) as a
        one-layer uint8 entry: checksummed, tiered and evicted like any chunk."""
        if len(data) < 2:
            raise ValueError(f"an entry of bytes needs at least 2 of them, got {len(data)}")
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        half = len(data) // 2          # a layer is K's bytes then V's: the halves
        return self.put(entry_id, [(t[:half], t[half:])], model_fingerprint=model_fingerprint, timeout=timeout)

    def get_bytes(self, entry_id: str, *, timeout: float | None = None) -> bytes:
        """What ``put_bytes`` stored (checked on receipt as any layer is); ChunkCorruptError for an entry of another
        kind, grpc.RpcError NOT_FOUND for none."""
        got = list(self.get(entry_id, timeout=timeout))
        if len(got) != 1 or got[0][1].dtype != torch.uint8:
            raise ChunkCorruptError(f"entry {entry_id} is not an entry of bytes")
        _, k, v = got[0]
        return k.numpy().tobytes() + v.numpy().tobytes()

    def get(self, chunk_id: str, *, layers: tuple[int, int] | None = None, timeout: float | None = None,
            device: torch.device | None = None, place=None) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield ``(layer_index, k, v)`` in layer order for layers [start, stop) (default: all).

        ``device``: a CUDA device the caller copies the layers to anyway; layers read from this host's store arena
        are then copied there here and checked there (``kernels.checksum``), and come as tensors on it (issued on the
        current stream, complete when yielded). Other layers come in host memory whatever it says.
        ``place``: the chunk's place from this client's ``lookup`` (``ChunkLocation.place``): the whole chunk is read
        from the arena without a Get, checked as ever; a place gone stale (the chunk moved or damaged) is read on by
        a Get.
        Raises grpc.RpcError NOT_FOUND for an unknown chunk, DATA_LOSS if no tier holds a good copy.
        """
        request = pb.GetRequest(chunk_id=chunk_id, local_host=host_id() if self.local else "",
                                nixl=self._nixl_endpoint() is not None)
        if layers is not None:
            start, stop = layers
            if not 0 <= start < stop:
                raise ValueError(f"layers must be (start, stop) with 0 <= start < stop, got {layers}")
            request.layer_start, request.layer_stop = start, stop
        expect = None
        if place is not None and layers is None:
            expect = yield from self._read_placed(chunk_id, place, device, request)
            if expect is True:
                return
        while True:         # twice at most: a read of a store's file that could not go on goes on by the stream
            call = self._get(request, timeout=timeout or self.timeout)
            try:
                yield from self._assemble(chunk_id, call, expect, asked_local=bool(request.local_host), device=device,
                                          asked_nixl=request.nixl)
                return
            except _LocalGone:
                self.fallbacks["gone"] += 1     # its file went away before it was opened: the bytes by the stream
            except _LocalDamaged as damaged:
                self._fell_back(damaged)
                request.layer_start, request.layer_stop = damaged.index, damaged.stop
                expect = damaged.checksums
            finally:
                call.cancel()     # no-op once finished; stops the stream when the caller breaks early
            request.local_host, request.nixl = "", False   # frames now: _assemble refuses a place it did not ask for

    def _fell_back(self, why: "_LocalDamaged") -> None:
        """Count a read of this host's tier that goes on by the stream: a moved extent, or a damaged layer."""
        moved = isinstance(why, _LocalMoved)
        self.local_damaged += not moved
        self.fallbacks["moved" if moved else "damaged"] += 1

    def _read_placed(self, chunk_id: str, place, device, request: pb.GetRequest):
        """The whole chunk from its arena place (``lookup``): True when read; else the checksums a Get must read on
        with, from the layer ``request`` now starts at (None: from the start), by the stream (as a Get's local read
        that could not go on is)."""
        request.local_host, request.nixl = "", False
        meta = _place_meta(chunk_id, place)
        try:
            yield from self._read_local(meta, _FROM_NAME[meta.dtype], 0, meta.num_layers, place.layers, device)
            return True
        except _LocalGone:
            self.fallbacks["gone"] += 1
            return None
        except _LocalDamaged as damaged:
            self._fell_back(damaged)
            request.layer_start, request.layer_stop = damaged.index, damaged.stop
            return damaged.checksums

    def _assemble(self, chunk_id: str, call, expect: tuple | None = None, asked_local: bool = False,
                  device: torch.device | None = None,
                  asked_nixl: bool = False) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """The layers a Get stream carries, checked; ``expect``: the checksums the chunk must have (a read resumed
        after a damaged local layer continues the same version); ``asked_local``: the request named this host, so
        the store may answer with its shared-memory file."""
        first = next(call, None)
        if first is None or isinstance(first, wire.Frame) or not first.HasField("header"):
            raise ChunkCorruptError(f"chunk {chunk_id}: the stream did not start with a header")
        try:
            meta = ChunkMeta.from_proto(first.header)
        except InvalidChunk as exc:
            raise ChunkCorruptError(f"chunk {chunk_id}: bad header: {exc}") from None
        if meta.chunk_id != chunk_id or len(meta.checksums) != meta.num_layers:
            raise ChunkCorruptError(f"chunk {chunk_id}: header names {meta.chunk_id} or lacks checksums")
        if expect is not None and tuple(meta.checksums) != tuple(expect):
            raise ChunkCorruptError(f"chunk {chunk_id}: another version than the one being read")
        dtype = _FROM_NAME[meta.dtype]
        index, stop = first.header.layer_start, first.header.layer_stop
        parts: list = []          # payloads of the current layer's frames (memoryviews into the messages)
        got = 0
        for msg in call:
            if not isinstance(msg, wire.Frame) and msg.HasField("local"):
                if not asked_local or index != first.header.layer_start:
                    raise ChunkCorruptError(f"chunk {chunk_id}: a shared-memory file not asked for, or after frames")
                yield from self._read_local(meta, dtype, index, stop, msg.local, device)
                return
            if not isinstance(msg, wire.Frame) and msg.HasField("nixl"):
                if not asked_nixl or index != first.header.layer_start:
                    raise ChunkCorruptError(f"chunk {chunk_id}: a NIXL place not asked for, or after frames")
                yield from self._read_nixl(meta, dtype, index, stop, msg.nixl)
                return
            frame = msg if isinstance(msg, wire.Frame) else msg.frame
            if not got and index == first.header.layer_start:
                self.reads["stream"] += 1
            if index >= stop or frame.layer_index != index:
                raise ChunkCorruptError(f"chunk {chunk_id}: frame for layer {frame.layer_index}, expected {index}")
            nbytes = meta.layer_nbytes(index)
            got += len(frame.data)
            if got > nbytes:
                raise ChunkCorruptError(f"chunk {chunk_id} layer {index}: more bytes than its shape holds")
            parts.append(frame.data)
            if not frame.end_of_layer:
                continue
            if got != nbytes:
                raise ChunkCorruptError(f"chunk {chunk_id} layer {index}: {got} bytes, expected {nbytes}")
            if self.verify and (frame.checksum != meta.checksums[index] or layer_checksum(tuple(parts)) != frame.checksum):
                raise ChunkCorruptError(f"chunk {chunk_id} layer {index}: checksum mismatch on receipt")
            buf = _layer_tensor(parts, nbytes)
            kn = meta.k_nbytes(index)
            yield (index, buf[:kn].view(dtype).reshape(meta.k_shapes[index]),
                   buf[kn:].view(dtype).reshape(meta.v_shapes[index]))
            index, parts, got = index + 1, [], 0
        if index != stop:
            raise ChunkCorruptError(f"chunk {chunk_id}: stream ended at layer {index} of [{first.header.layer_start}, {stop})")

    def _read_local(self, meta: ChunkMeta, dtype, start: int, stop: int, local, device=None) -> Iterator:
        """Layers [start, stop) read from the store's shared-memory file, each checked against its crc32: up to
        ``LOCAL_READ_AHEAD`` layers at once on the client's reader threads (the read and the crc release the
        interpreter lock), yielded in order as each is ready."""
        if len(local.offsets) != stop - start:
            raise ChunkCorruptError(f"chunk {meta.chunk_id}: {len(local.offsets)} offsets for layers [{start}, {stop})")
        if local.generation:
            yield from self._read_arena(meta, dtype, start, stop, local, device)
            return
        try:
            fd = os.open(local.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise _LocalGone() from None
        except OSError as exc:      # not readable by this process: this host's store is not for it
            raise ChunkCorruptError(f"chunk {meta.chunk_id}: cannot open the store's file: {exc}") from None
        self.local_reads += 1
        self.reads["file"] += 1
        if self._readers is None:
            self._readers = ThreadPoolExecutor(LOCAL_READ_AHEAD, thread_name_prefix="kv-local-read")

        def read(index: int, offset: int) -> torch.Tensor:
            nbytes = meta.layer_nbytes(index)
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
            if os.preadv(fd, [buf.numpy()], offset) != nbytes:
                raise ChunkCorruptError(f"chunk {meta.chunk_id} layer {index}: its file ends early")
            if checksum(buf.numpy()) != meta.checksums[index]:
                raise ChunkCorruptError(f"chunk {meta.chunk_id} layer {index}: checksum mismatch in the store's file")
            return buf

        todo = list(zip(range(start, stop), local.offsets))
        pending = [self._readers.submit(read, *todo[j]) for j in range(min(LOCAL_READ_AHEAD, len(todo)))]
        try:
            for j, (index, _) in enumerate(todo):
                try:
                    buf = pending[j].result()
                except ChunkCorruptError as exc:
                    raise _LocalDamaged(index, stop, tuple(meta.checksums), str(exc)) from None
                if j + LOCAL_READ_AHEAD < len(todo):
                    pending.append(self._readers.submit(read, *todo[j + LOCAL_READ_AHEAD]))
                kn = meta.k_nbytes(index)
                yield (index, buf[:kn].view(dtype).reshape(meta.k_shapes[index]),
                       buf[kn:].view(dtype).reshape(meta.v_shapes[index]))
        finally:
            for f in pending:           # the descriptor stays open until no read uses it
                f.cancel()
            wait(pending)
            os.close(fd)

    def _read_arena(self, meta: ChunkMeta, dtype, start: int, stop: int, local, device=None) -> Iterator:
        """Layers [start, stop) from the store's arena segment, mapped here once (registered with CUDA on a GPU host,
        so a copy to the GPU reads it at the pinned rate). Onto a CUDA ``device``: copied there and checked there
        (``_arena_to_device``). Else as views of the segment (no copy): all checked against their crc32 at once on
        ``ARENA_CHECKERS`` threads, each handed on in order once checked, while the extent's header still holds the
        generation the store named and within ``ARENA_READ_WINDOW_S`` of the read's start (a freed extent rests for
        the store's grace, so the caller's copy reads what was checked)."""
        began = time.monotonic()
        seg, spans = self._arena_spans(meta, start, stop, local)
        self.local_reads += 1
        self.arena_reads += 1
        if device is not None and torch.device(device).type in self.check_on:
            self.reads["arena-device"] += 1
            yield from self._arena_to_device(meta, dtype, stop, local, seg, spans, torch.device(device))
            return
        self.reads["arena"] += 1
        if self._checkers is None:
            self._checkers = ThreadPoolExecutor(ARENA_CHECKERS, thread_name_prefix="kv-arena-check")

        def check(index: int, offset: int, nbytes: int) -> bool:
            return checksum(seg.array[offset:offset + nbytes]) == meta.checksums[index]

        pending = [self._checkers.submit(check, *span) for span in spans]     # every layer at once: views cost nothing
        try:
            for (index, offset, nbytes), checked in zip(spans, pending):
                good = checked.result()
                moved = seg.header(local.header) != local.generation
                if moved or time.monotonic() - began > ARENA_READ_WINDOW_S:
                    raise _LocalMoved(index, stop, tuple(meta.checksums), "the extent moved on or the read was slow")
                if not good:
                    raise _LocalDamaged(index, stop, tuple(meta.checksums),
                                        f"chunk {meta.chunk_id} layer {index}: checksum mismatch in the store's arena")
                buf, kn = seg.bytes[offset:offset + nbytes], meta.k_nbytes(index)
                yield (index, buf[:kn].view(dtype).reshape(meta.k_shapes[index]),
                       buf[kn:].view(dtype).reshape(meta.v_shapes[index]))
        finally:
            for f in pending:
                f.cancel()
            wait(pending)

    def _arena_spans(self, meta: ChunkMeta, start: int, stop: int, local) -> tuple:
        """(the mapped segment, [(layer, offset, bytes)] for layers [start, stop)) of an arena place; _LocalGone when
        its segment file is gone, ChunkCorruptError when it cannot be read here or the offsets run past it."""
        try:
            seg = self.segments.open(local.path)
        except FileNotFoundError:
            raise _LocalGone() from None
        except OSError as exc:      # not readable by this process: this host's store is not for it
            raise ChunkCorruptError(f"chunk {meta.chunk_id}: cannot open the store's segment: {exc}") from None
        spans = [(i, offset, meta.layer_nbytes(i)) for i, offset in zip(range(start, stop), local.offsets)]
        if len(spans) != stop - start or any(o + n > seg.size for _, o, n in spans) or local.header + 16 > seg.size:
            raise ChunkCorruptError(f"chunk {meta.chunk_id}: offsets past the end of the store's segment")
        return seg, spans

    def _arena_to_device(self, meta: ChunkMeta, dtype, stop: int, local, seg, spans, device) -> Iterator:
        """Layers in groups (``_groups``), copied onto ``device`` and checked there (``_DeviceIssue``); a group is
        handed on once its check has passed."""
        issued = _DeviceIssue(self, meta, dtype, stop, local, seg, spans, device)
        for g, views in enumerate(issued.views):
            issued.check(g)
            yield from views

    def device_read(self, chunk_id: str, place, device) -> DeviceRead | None:
        """A whole chunk from its arena place (``lookup``) onto CUDA ``device``, its checks deferred: iterating the
        result queues every copy and check on the current stream and yields ``(layer, k, v)`` views of the landed
        bytes at once, before they have landed; ``verify()`` then waits for the checks and raises ChunkCorruptError
        if a layer's bytes are not the header's or the extent moved on. Whoever uses the layers must verify first,
        and recompute the chunk if it fails. None where this read does not apply (no place here, a device the
        checks do not run on, a segment gone, or a chunk whose last deferred read failed: its next read goes by a
        Get, where the store checks its own copy and drops a damaged one)."""
        if place is None or torch.device(device).type not in self.check_on:
            return None
        with self._lock:
            if chunk_id in self._refused:
                self._refused.discard(chunk_id)
                return None
        meta = _place_meta(chunk_id, place)
        try:
            seg, spans = self._arena_spans(meta, 0, meta.num_layers, place.layers)
        except _LocalGone:
            return None
        return DeviceRead(self, meta, _FROM_NAME[meta.dtype], place.layers, seg, spans, torch.device(device))

    def _nixl_endpoint(self):
        """This process's NIXL endpoint when this client reads over NIXL and NIXL can be used here, else None."""
        if not self.nixl or self.nixl_unavailable:
            return None
        from services.handoff.nixl import NixlUnavailable, process_endpoint

        try:
            return process_endpoint()
        except NixlUnavailable as exc:
            self.nixl_unavailable = str(exc)
            return None

    def _staging(self, ep, nbytes: int) -> torch.Tensor:
        """The registered buffer NIXL reads land in (grown, and registered again, as chunks need)."""
        if self._nixl_buf is None or self._nixl_buf.numel() < nbytes:
            if self._nixl_buf is not None:
                ep.deregister(self._nixl_buf)
            self._nixl_buf = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, pin_memory=self.pin)
            ep.register([self._nixl_buf])
        return self._nixl_buf

    def _read_nixl(self, meta: ChunkMeta, dtype, start: int, stop: int, place) -> Iterator:
        """Layers [start, stop) read over NIXL from the store's registered arena, then the extent's header: handed on
        (copied out of the staging buffer) only if the header still holds the generation the store named and each
        layer passes its CRC-32. A transfer that fails or a moved extent goes on by the stream (``_LocalMoved``), a
        damaged layer too, from that layer (``_LocalDamaged``: the store checks its copy and drops a bad one)."""
        from services.handoff.nixl import TransferFailed

        ep = self._nixl_endpoint()
        checksums = tuple(meta.checksums)
        sizes = [meta.layer_nbytes(i) for i in range(start, stop)]
        with self._nixl_lock:
            buf = self._staging(ep, 16 + sum(sizes))
            head, views, at = buf[:16], [], 16
            for n in sizes:
                views.append(buf[at:at + n])
                at += n
            try:
                ep.read_descs(place.agent, place.metadata, place.descs, views, timeout=self.timeout)
                ep.read_descs(place.agent, place.metadata, place.header_descs, [head], timeout=self.timeout)
            except (TransferFailed, ValueError) as exc:
                raise _LocalMoved(start, stop, checksums, f"the NIXL read failed: {exc}") from None
            if int.from_bytes(head[8:16].numpy().tobytes(), "little") != place.generation:
                raise _LocalMoved(start, stop, checksums, "the extent moved on during the NIXL read")
            self.reads["nixl"] += 1
            good = []
            for i, view in zip(range(start, stop), views):
                if checksum(view.numpy()) != meta.checksums[i]:
                    break
                good.append(view.clone())
        for i, buf_i in zip(range(start, stop), good):
            kn = meta.k_nbytes(i)
            yield (i, buf_i[:kn].view(dtype).reshape(meta.k_shapes[i]), buf_i[kn:].view(dtype).reshape(meta.v_shapes[i]))
        if len(good) < len(sizes):
            bad = start + len(good)
            raise _LocalDamaged(bad, stop, checksums, f"chunk {meta.chunk_id} layer {bad}: checksum mismatch read over NIXL")

    def in_arena(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a view of the store's arena (``_read_arena``): memory the store reuses after its grace, so
        whoever keeps the layer copies it."""
        return self.segments.holds(t)

    def lookup(self, chunk_ids: Sequence[str], *, timeout: float | None = None) -> list[ChunkLocation]:
        """Which tiers hold each chunk (one answer per id, in order)."""
        request = pb.LookupRequest(chunk_ids=list(chunk_ids), local_host=host_id() if self.local else "")
        resp = self._stub.Lookup(request, timeout=timeout or self.timeout)
        if resp.arena_directory and self.local:
            self.segments.watch(resp.arena_directory)
        return [ChunkLocation(c.chunk_id, c.found, tuple(TIER_OF_PB[t] for t in c.tiers), c.nbytes,
                              c.local if c.HasField("local") else None) for c in resp.chunks]

    def delete(self, chunk_id: str, *, timeout: float | None = None) -> bool:
        """Remove a chunk from every tier; False if no tier held it."""
        return self._stub.Delete(pb.DeleteRequest(chunk_id=chunk_id), timeout=timeout or self.timeout).deleted

    def stats(self, *, timeout: float | None = None) -> pb.StatsResponse:
        return self._stub.Stats(pb.StatsRequest(), timeout=timeout or self.timeout)

    def wait_ready(self, timeout: float = 10.0) -> None:
        grpc.channel_ready_future(self._channel).result(timeout=timeout)

    def close(self) -> None:
        self._channel.close()
        for pool in (self._readers, self._checkers):
            if pool is not None:
                pool.shutdown(wait=True)
        self.segments.close()

    def __enter__(self) -> "KVStoreClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
