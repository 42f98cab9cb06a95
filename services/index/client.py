"""Synchronous client of the retrieval-index service, with the same calls as an in-process ``IndexSet`` (``add``,
``hold``, ``attend``, ``drop``, ``held``), so a decode engine uses either as its index set.

An offload streams its keys, values and training queries as float32 bytes in ~1 MiB parts after a header carrying
their CRC32; a search sends one layer's queries of the whole batch and receives each row's partial attention. Every
call carries a deadline (``timeout`` seconds; an offload, which waits for its indexes' build, ``offload_timeout``).
Server errors surface as ``grpc.RpcError`` with the status code.
"""

from __future__ import annotations

import zlib

import grpc
import numpy as np

from services.index import half
from services.index.heads import Answer
from services.index.server import as_tensor
from services.rpc import index_pb2 as pb
from services.rpc import index_pb2_grpc as pb_grpc

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 8 << 20), ("grpc.max_send_message_length", 8 << 20)]
PART_BYTES = 1 << 20


def _framed(part, header, body: bytes):
    """A client stream's messages (``part``: the message type with its ``header`` / ``data`` oneof): the header,
    then ``body`` in ~1 MiB parts."""
    yield part(header=header)
    view = memoryview(body)
    for at in range(0, len(body), PART_BYTES):
        yield part(data=bytes(view[at:at + PART_BYTES]))


class IndexClient:
    """The index service at ``address`` ("host:port"). ``tls``: this caller's ClusterTLS (mutual TLS; the service
    must prove the index role), None: a plain channel. ``host_dtype``: the dtype ``add`` sends keys and values in
    (``half.DTYPES``; bfloat16: their bits, half the bytes), float32 or bfloat16 bits given to it converted first; the
    service holds them in its own (``create_server(host_dtype=)``)."""

    def __init__(self, address: str, *, timeout: float = 30.0, offload_timeout: float | None = None, tls=None,
                 host_dtype: str = half.FLOAT32) -> None:
        self.host_dtype = half.check_dtype("host_dtype", host_dtype)
        offload_timeout = timeout if offload_timeout is None else offload_timeout
        if timeout <= 0 or offload_timeout <= 0:
            raise ValueError(f"timeouts must be positive, got {timeout} and {offload_timeout}")
        self.address, self.timeout, self.offload_timeout = address, timeout, offload_timeout
        self._channel = (grpc.insecure_channel(address, options=CHANNEL_OPTIONS) if tls is None else
                         grpc.secure_channel(address, tls.channel_credentials(),
                                             options=[*CHANNEL_OPTIONS, *tls.channel_options("index")]))
        self._stub = pb_grpc.RetrievalIndexStub(self._channel)
        self._put: set[str] = set()   # chunk ids whose index this client has put
        self._held: set[tuple[str, int]] = set()   # (owner, layer) this client's hold sent and its add has not indexed

    def add(self, owner: str, layer: int, keys: np.ndarray, values: np.ndarray, train_queries: np.ndarray,
            chunks=(), lists: np.ndarray | None = None) -> int:
        """As ``IndexSet.add`` (``lists`` travel as int32); returns the indexes' bytes. The chunks' indexes are put
        first where this client has not put them yet, and again, once, when the service answers that it no longer holds
        one (evicted). A layer this client's ``hold`` sent goes as its shape alone (``keys_held``): the service indexes
        the keys and values it holds."""
        keys_held = (owner, layer) in self._held
        self._held.discard((owner, layer))
        kv_shape = list(np.shape(keys))
        train = np.ascontiguousarray(train_queries, "<f4")
        arrays = [train] + ([] if lists is None else [np.ascontiguousarray(lists, "<i4")])
        if not keys_held:
            arrays = [half.stored(a, self.host_dtype) for a in (keys, values)] + arrays
        body = b"".join(a.tobytes() for a in arrays)
        header = pb.OffloadHeader(owner=owner, layer=layer, kv_shape=kv_shape, train_shape=list(train.shape),
                                  crc32=zlib.crc32(body), kv_dtype=self.host_dtype, keys_held=keys_held,
                                  lists_shape=[] if lists is None else list(np.shape(lists)),
                                  chunks=[pb.ChunkRun(chunk_id=cid, length=index.length) for cid, index in chunks])

        def parts():
            return _framed(pb.OffloadPart, header, body)

        for cid, index in chunks:
            if cid not in self._put:
                self.put_chunk_index(cid, index)
        try:
            return self._stub.Offload(parts(), timeout=self.offload_timeout).index_bytes
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION or not chunks:
                raise
        for cid, index in chunks:
            self.put_chunk_index(cid, index)
        return self._stub.Offload(parts(), timeout=self.offload_timeout).index_bytes

    def hold(self, owner: str, layer: int, keys: np.ndarray, values: np.ndarray) -> None:
        """As ``IndexSet.hold``: a layer's keys and values (N >= 1) alone, scanned whole by every search of the service
        until this client's ``add`` of the layer indexes them there."""
        keys, values = (half.stored(a, self.host_dtype) for a in (keys, values))
        body = keys.tobytes() + values.tobytes()
        hkv, _, d = keys.shape
        header = pb.OffloadHeader(owner=owner, layer=layer, kv_shape=list(keys.shape), train_shape=[hkv, 0, d],
                                  crc32=zlib.crc32(body), kv_dtype=self.host_dtype, hold=True)
        self._stub.Offload(_framed(pb.OffloadPart, header, body), timeout=self.offload_timeout)
        self._held.add((owner, layer))

    def put_chunk_index(self, chunk_id: str, index) -> None:
        """Hand the service a chunk's index (``chunks.ChunkIndex``), for offloads that name the chunk."""
        blob = index.to_bytes()
        header = pb.ChunkIndexHeader(chunk_id=chunk_id, nbytes=len(blob))
        self._stub.PutChunkIndex(_framed(pb.ChunkIndexPart, header, blob), timeout=self.offload_timeout)
        self._put.add(chunk_id)

    def attend(self, layer: int, owners: list[str], queries: np.ndarray, k: int, scale: float,
               beam: int | None = None) -> Answer:
        """As ``IndexSet.attend``: one layer of a decode step for every row."""
        req = pb.SearchRequest(layer=layer, owners=owners, queries=as_tensor(queries), k=k, scale=scale)
        if beam is not None:
            req.beam = beam
        reply = self._stub.Search(req, timeout=self.timeout)
        # copies: the reply is small, and its arrays are the caller's to write
        out = np.frombuffer(reply.out.data, "<f4").reshape(tuple(reply.out.shape)).copy()
        lse = np.frombuffer(reply.lse.data, "<f4").reshape(tuple(reply.lse.shape)).copy()
        return Answer(out, lse, np.asarray(reply.scanned, np.int64), reply.seconds)

    def drop(self, owner: str) -> int:
        self._held -= {key for key in self._held if key[0] == owner}
        return self._stub.Drop(pb.DropRequest(owner=owner), timeout=self.timeout).layers

    def held(self) -> tuple[int, int, int]:
        s = self._stub.Status(pb.IndexStatusRequest(), timeout=self.timeout)
        return s.owners, s.kv_bytes, s.index_bytes

    def nbytes(self) -> int:
        return self.held()[1]

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "IndexClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
