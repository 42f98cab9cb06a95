"""Prefill-to-decode hand-off transport: chosen once at start, reported in Stats.

Between workers on one host's GPUs the private K/V stay on the GPUs (``cuda_ipc``: copied on the device, or GPU
to GPU; the stream carries only the small rest of the hand-off). Otherwise the hand-off is a gRPC client stream to the decode
worker's ``PushHandoff``: a ``HandoffHeader`` then the payload in ~1 MiB parts, checked against the
header's length and crc32 (zlib's value, computed by ISA-L) on arrival. With ``handoff_transport="nixl"``
the stream carries a NIXL offer instead of the K/V, which the decode worker reads from the prefill
worker's registered memory (``nixl.py``) and checks before it acknowledges; where NIXL cannot load, the
stream carries them and the report says why.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.cluster.serving import PART_BYTES
from services.kvstore.chunk import checksum
from services.rpc import tessera_pb2 as pb

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class TransportChoice:
    name: str        # the transport hand-offs use: "grpc"
    detail: str      # why, for Stats and logs


def probe_transport(device=None, want: str = "auto", nixl_failed: str = "") -> TransportChoice:
    """The hand-off transport of a worker on ``device``: ``want`` "nixl" reads the K/V over NIXL where it loads (else
    the gRPC stream, saying why); "auto" and "grpc" stream them; on a GPU, CUDA IPC to decode workers on this host's
    GPUs that can open its buffers. ``nixl_failed``: why NIXL, asked for, no longer serves this worker (it could not
    offer its memory): the choice without it, saying so."""
    ipc = device is not None and device.type == "cuda"
    found = [m for m in ("nixl", "nixl_cu13", "nixl_cu12") if importlib.util.find_spec(m) is not None]
    nixl = ("nixl is not installed" if not found
            else f"{found[0]} found, not asked for (handoff_transport='nixl')")
    if nixl_failed:
        want, nixl = "auto", f"nixl asked for, but {nixl_failed}"
    if want == "nixl":
        from services.handoff.nixl import NixlUnavailable, nixl_module

        try:
            nixl_module()       # found, not loaded: the first hand-off loads it, and streams its K/V if it fails
            return TransportChoice("nixl", ("cuda-ipc to decode workers on this host's GPUs, else " if ipc else "")
                                   + f"nixl (UCX) reads of the K/V ({found[0]}), checked on landing")
        except NixlUnavailable as exc:
            nixl = f"nixl asked for but unavailable: {exc}"
    if ipc:
        return TransportChoice("cuda-ipc", f"cuda-ipc to decode workers on this host's GPUs, else grpc stream ({nixl})")
    return TransportChoice("grpc", f"grpc stream ({nixl})")


@dataclass(frozen=True, slots=True)
class ReceivedHandoff:
    """A complete hand-off as the decode worker holds it until ``Decode`` asks for it
    (kind "engine": ``payload`` is ``services.engine.Handoff.to_bytes()``, without the K/V when the
    header names a CUDA IPC buffer: then ``kv`` holds them)."""

    header: pb.HandoffHeader
    payload: bytes
    kv: torch.Tensor | None = None    # the K/V the payload left out (copied out of a CUDA IPC buffer)


def handoff_parts(header: pb.HandoffHeader, payload: bytes) -> Iterator[pb.HandoffPart]:
    header.total_bytes = len(payload)
    header.crc32 = checksum(payload)
    yield pb.HandoffPart(header=header)
    view = memoryview(payload)
    for off in range(0, len(view), PART_BYTES):
        yield pb.HandoffPart(data=bytes(view[off:off + PART_BYTES]))


class HandoffError(ValueError):
    """A hand-off stream that is malformed or arrived damaged."""


async def receive_handoff(parts: AsyncIterator[pb.HandoffPart]) -> ReceivedHandoff:
    """The hand-off a stream carries, checked. Its parts are kept as they arrive and joined once (one copy of the
    payload), and the crc32 runs off the event loop (ISA-L's, which releases the interpreter lock): 71 ms for a
    69 MiB hand-off where growing a buffer part by part, zlib's crc32 on the loop and a copy out took 155
    (bench/handoff/handoff_stream.py, this repository's 2-core machine)."""
    header = None
    chunks, n = [], 0
    async for part in parts:
        if header is None:
            if not part.HasField("header"):
                raise HandoffError("a hand-off must start with its header")
            header = part.header
            continue
        if part.HasField("header"):
            raise HandoffError("a second header inside one hand-off")
        data = part.data  # (each read of the field is a new bytes object)
        chunks.append(data)
        n += len(data)
        if n > header.total_bytes:
            raise HandoffError(f"hand-off {header.request_id}: more than the announced {header.total_bytes} bytes")
    if header is None:
        raise HandoffError("empty hand-off stream")
    payload = b"".join(chunks)
    del chunks
    if n != header.total_bytes or await asyncio.to_thread(checksum, payload) != header.crc32:
        raise HandoffError(f"hand-off {header.request_id}: {n} of {header.total_bytes} bytes or a bad crc32")
    return ReceivedHandoff(header, payload)
