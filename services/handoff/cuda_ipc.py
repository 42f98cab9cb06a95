"""Hand-offs between workers on one host's GPUs: the private K/V never cross the host.

The prefill worker concatenates the request's private K/V into one device buffer and exports it
with CUDA IPC (torch.multiprocessing's reduction of a CUDA tensor; its fields travel in a
``CudaIpcBuffer`` message, not as a pickle); only the rest of the hand-off (chunk ids, positions,
logits: a few KB) goes through the gRPC stream. The decode worker opens the buffer, copies it into
its own memory on its GPU (on the device when they share one, GPU to GPU over NVLink or PCIe
peer-to-peer when not), closes it and only then acknowledges the push; the prefill worker holds the
buffer until that acknowledgement. Without IPC this is the gRPC path's 4-8 host copies of every
private byte, on two Python processes' CPUs: a pair of H200s apart served a quarter of what one
shared GPU did that way (bench/cluster/README.md).

The buffer is a piece of the prefill worker's slab (``IpcSlab``, shared once; ``share_from_slab``) where it has
one with room: the decode worker opens a slab at its first piece and keeps it open (``KEPT_SLABS``, closed after
``KEPT_IDLE_S`` unused), so that a hand-off opens nothing. Without the slab, or without room in it, the hand-off's
own buffer is shared and opened, as above.

A process opens only the buffers of GPUs it sees, so a worker process is started seeing its own GPU
first (its ``cuda``) and the host's others after it (``gpu_order``); the buffer names its GPU by
uuid, which every process maps to its own index. Whether a decode worker can take a prefill
worker's buffer is decided from their ``WorkerStatus``: same ``host_id`` (hostname and boot id), and
the prefill worker's ``device_uuid`` among the decode worker's ``ipc_gpus``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from functools import lru_cache

import torch

from services.cluster.staging import side_stream
from services.handoff.slab import Slab, device_key
from services.hostid import host_id
from services.rpc import tessera_pb2 as pb

__all__ = ["host_id", "device_uuid", "visible_uuids", "placement", "same_gpu", "ipc_reaches", "gpu_order",
           "local_index", "share", "copy_out", "IpcSlab", "process_ipc_slab", "share_from_slab", "close_idle_slabs"]

log = logging.getLogger(__name__)

# NOTE: opening a buffer (torch's rebuild_cuda_tensor: cudaIpcOpenMemHandle, the export's event, its ref counter)
# holds the interpreter lock: a profile of four decode workers on four H100s found them holding it 12-30% of the
# replay there, beside an engine thread holding it 5-9% (bench/cluster/README.md). A prefill worker therefore shares
# one slab once and sends pieces of it; a decode worker opens each sender's slab once and keeps it open.
IPC_SLAB_BYTES = 1 << 30        # default size of a GPU prefill worker's CUDA IPC slab (its settings' ipc_slab_bytes)
KEPT_SLABS = 8                  # senders' slabs a receiving process keeps open (least recently used closed first)
# a kept slab no piece came from for this long is closed: an open slab keeps its sender's GPU memory allocated, also
# after that sender has stopped (a prefill worker restarted makes a new slab)
KEPT_IDLE_S = 60.0


def device_uuid(device: torch.device) -> str:
    """The GPU's UUID, "" for a CPU device (no IPC there)."""
    if device.type != "cuda":
        return ""
    return visible_uuids()[device.index if device.index is not None else torch.cuda.current_device()]


@lru_cache(maxsize=1)
def visible_uuids() -> tuple[str, ...]:
    """The uuids of the GPUs this process sees, by its device index ("" for one without a uuid)."""
    if not torch.cuda.is_available():
        return ()
    return tuple(str(getattr(torch.cuda.get_device_properties(i), "uuid", "")) for i in range(torch.cuda.device_count()))


def placement(device: torch.device) -> dict:
    """This worker's machine and GPUs, as the ``WorkerStatus`` fields ``same_gpu`` and ``ipc_reaches`` compare."""
    own = device_uuid(device)
    return {"host_id": host_id(), "device_uuid": own,
            "ipc_gpus": [u for u in visible_uuids() if u] if own else []}


def same_gpu(a: pb.WorkerStatus, b: pb.WorkerStatus) -> bool:
    return bool(a.device_uuid) and a.host_id == b.host_id and a.device_uuid == b.device_uuid


def ipc_reaches(sender: pb.WorkerStatus, receiver: pb.WorkerStatus) -> bool:
    """Whether ``receiver`` can open CUDA IPC buffers of ``sender``'s GPU: one host, and the GPU among those it sees."""
    return (bool(sender.device_uuid) and sender.host_id == receiver.host_id
            and (sender.device_uuid == receiver.device_uuid or sender.device_uuid in receiver.ipc_gpus))


def gpu_order(own: str, visible: list[str]) -> str:
    """CUDA_VISIBLE_DEVICES for a worker process of GPU ``own``: it first (the process's ``cuda``), then the rest
    of ``visible`` (the GPUs whose hand-off buffers it can open)."""
    if own not in visible:
        raise ValueError(f"GPU {own!r} is not among the visible GPUs {visible}")
    return ",".join([own] + [g for g in visible if g != own])


def local_index(uuid: str, fallback: int) -> int:
    """This process's index of the GPU of ``uuid`` ("" keeps ``fallback``, a sender's own index: one process's
    numbering, right only when both see the same GPUs in the same order)."""
    if not uuid:
        return fallback
    try:
        return visible_uuids().index(uuid)
    except ValueError:
        raise ValueError(f"CUDA IPC buffer on GPU {uuid}, which this process does not see "
                         f"(it sees {len(visible_uuids())})") from None


def share(buf: torch.Tensor) -> pb.CudaIpcBuffer:
    """Export a contiguous CUDA tensor; the caller keeps ``buf`` alive until the peer has copied it."""
    from torch.multiprocessing.reductions import reduce_tensor

    if buf.device.type != "cuda" or not buf.is_contiguous():
        raise ValueError("only a contiguous CUDA tensor can be shared over CUDA IPC")
    _, args = reduce_tensor(buf)
    (_, size, _, offset, _, dtype, device, handle, size_bytes, offset_bytes, _, ref_handle, ref_offset,
     event_handle, event_sync) = args
    return pb.CudaIpcBuffer(dtype=str(dtype).removeprefix("torch."), numel=int(torch.Size(size).numel()),
                            storage_handle=handle, storage_size_bytes=size_bytes, storage_offset_bytes=offset_bytes,
                            ref_counter_handle=ref_handle, ref_counter_offset=ref_offset,
                            event_handle=event_handle or b"", event_sync_required=bool(event_sync),
                            device_index=int(device), tensor_offset=int(offset),
                            device_uuid=device_uuid(buf.device))


def open_on(dst: torch.device, src: int) -> int:
    """The GPU (index) on which a buffer of GPU ``src`` is opened to be copied onto ``dst``: ``dst`` itself where it
    can read ``src``'s memory (peer to peer), so that this process makes no context on the sender's GPU and queues no
    copy there, where the sender's own work and every other receiver's would share it; else ``src``."""
    if dst.index is None or dst.index == src or not _reads_peer(dst.index, src):
        return src
    return dst.index


@lru_cache(maxsize=None)
def _reads_peer(dst: int, src: int) -> bool:
    """Whether GPU ``dst`` can read GPU ``src``'s memory: fixed for the process, asked once a pair, not a hand-off."""
    return torch.cuda.can_device_access_peer(dst, src)


def copy_out(msg: pb.CudaIpcBuffer, device: torch.device | None = None, on_sender: bool = False) -> torch.Tensor:
    """Open a shared buffer, copy it into this process's memory on ``device`` (default: the buffer's GPU), close it.
    A slab of another GPU (opened once, kept) is opened on ``device`` (``open_on``) and its pieces copied there,
    reading the sender's GPU peer to peer; ``on_sender`` opens it on the sender's GPU, the copy queued on that GPU's
    stream. A buffer shared on its own is still opened on the sender's GPU: opened on the receiver's, a 69 MiB one
    took 1.80 ms where the sender's GPU took 0.65-0.79 on other machines (``bench/handoff/README.md``), not yet
    compared on one."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    dtype = getattr(torch, msg.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"CUDA IPC buffer of unknown dtype {msg.dtype!r}")
    src = local_index(msg.device_uuid, msg.device_index)
    if device is not None and device.type != "cuda":
        raise ValueError(f"a CUDA IPC buffer is copied to a GPU, not to {device}")
    dst = torch.device("cuda", src if device is None
                       else device.index if device.index is not None else torch.cuda.current_device())
    # on a stream of its own: the copy waits for the sender's export event, not behind this process's
    # queued work (the decode steps its engine thread keeps issuing on the current stream)
    consumer = torch.cuda.current_stream(dst)
    side = side_stream(dst, "ipc-copy")
    at = src if on_sender or not msg.slab else open_on(dst, src)
    with torch.cuda.stream(side):
        # opening it queues a wait for the sender's event on the current stream of the GPU it is opened on (``side``
        # when that is ``dst``); a copy from a buffer opened on the sender's GPU runs on that GPU's current stream in
        # this process, and the destination's (``side``) waits for it
        if msg.slab:
            shared = _slab_piece(msg, at, dtype)
        else:
            shared = rebuild_cuda_tensor(torch.Tensor, (msg.numel,), (1,), msg.tensor_offset, torch.UntypedStorage,
                                         dtype, at, msg.storage_handle, msg.storage_size_bytes,
                                         msg.storage_offset_bytes, False, msg.ref_counter_handle,
                                         msg.ref_counter_offset, msg.event_handle or None, msg.event_sync_required)
        own = shared.clone() if shared.device == dst else torch.empty_like(shared, device=dst).copy_(shared)
    side.synchronize()                  # copied before the sender may free it
    own.record_stream(consumer)         # its memory is not reused while the consumer's kernels may read it
    del shared
    return own


class IpcSlab(Slab):
    """A GPU's memory shared over CUDA IPC once (``message``: every field but the piece's), lent in pieces: a hand-off's
    K/V are copied into a piece and the piece is named to the receiver (``share_from_slab``), which keeps the slab open
    (``copy_out``). Whoever reads a piece may read the slab's other pieces too: they hold other hand-offs' K/V of
    this worker, for peers of this host that could open its per-hand-off buffers as well."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        if torch.device(device).type != "cuda":
            raise ValueError(f"a CUDA IPC slab is GPU memory, not {device}")
        super().__init__(nbytes, device)
        self.message = share(self.data)


_ipc_slabs: dict[str, IpcSlab] = {}
_no_ipc_slab: dict[str, str] = {}
_ipc_lock = threading.Lock()


def process_ipc_slab(device: torch.device, nbytes: int | None = None) -> IpcSlab | None:
    """This process's CUDA IPC slab on ``device``, made at first use with ``nbytes`` (default ``IPC_SLAB_BYTES``;
    later calls get that one whatever they ask); None when ``nbytes`` is 0, for a device that is no GPU, or (said once
    in the log) where none can be made: hand-offs there share buffers of their own."""
    device = torch.device(device)
    if nbytes == 0 or device.type != "cuda":
        return None
    key = device_key(device)
    with _ipc_lock:
        if key in _ipc_slabs or key in _no_ipc_slab:
            return _ipc_slabs.get(key)
        try:
            _ipc_slabs[key] = IpcSlab(IPC_SLAB_BYTES if nbytes is None else nbytes, torch.device(key))
        except Exception as exc:    # noqa: BLE001 - no room on the GPU, or no IPC there: buffers of their own
            _no_ipc_slab[key] = str(exc)
            log.warning("no CUDA IPC slab on %s (%s): hand-offs there share buffers of their own", key, exc)
            return None
        return _ipc_slabs[key]


def share_from_slab(buf: torch.Tensor, slab: IpcSlab | None) -> tuple[torch.Tensor | None, pb.CudaIpcBuffer]:
    """Share contiguous CUDA ``buf`` for a peer to copy: from a piece of ``slab`` (the bytes copied in and the copy
    waited for, so the peer reads them without an event), or, with no slab or no room in it, ``buf`` itself
    (``share``). Returns (the piece: give it back to the slab once the peer has copied it; None when ``buf`` was
    shared, which the caller then keeps alive until then, the message)."""
    raw = buf.reshape(-1).view(torch.uint8)
    piece = None if slab is None or not raw.numel() else slab.take(raw.numel())
    if piece is None:
        return None, share(buf)
    try:
        piece.copy_(raw)
        torch.cuda.current_stream(piece.device).synchronize()
        base = slab.data.untyped_storage().data_ptr()
        msg = pb.CudaIpcBuffer()
        msg.CopyFrom(slab.message)
        msg.dtype, msg.numel = str(buf.dtype).removeprefix("torch."), buf.numel()
        msg.tensor_offset = (piece.data_ptr() - base) // buf.element_size()
        msg.slab = True
        return piece, msg
    except BaseException:
        slab.give(piece)
        raise


# (slab handle, its offset, the GPU it is opened on) -> (the opened slab, last used)
_kept: OrderedDict[tuple[bytes, int, int], tuple[torch.UntypedStorage, float]] = OrderedDict()
_kept_lock = threading.Lock()


def close_idle_slabs(now: float | None = None) -> int:
    """Close the kept slabs no piece came from in ``KEPT_IDLE_S`` (a decode worker calls this on a timer too);
    returns how many were closed."""
    now = time.monotonic() if now is None else now
    with _kept_lock:
        idle = [key for key, (_, used) in _kept.items() if now - used > KEPT_IDLE_S]
        for key in idle:
            del _kept[key]
    return len(idle)


def _slab_piece(msg: pb.CudaIpcBuffer, at: int, dtype: torch.dtype) -> torch.Tensor:
    """The piece of a sender's slab that ``msg`` names, opened on GPU ``at`` (the sender's, or one that reads it peer to
    peer: ``open_on``): the slab opened at its first piece and kept open (``KEPT_SLABS`` of them), so that later
    pieces open nothing. ValueError when the piece is not inside it."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    key = (msg.storage_handle, msg.storage_offset_bytes, at)
    now = time.monotonic()
    close_idle_slabs(now)
    with _kept_lock:
        storage = _kept.get(key, (None, 0.0))[0]
        if storage is not None:
            _kept[key] = (storage, now)
            _kept.move_to_end(key)
    if storage is None:
        whole = rebuild_cuda_tensor(torch.Tensor, (msg.storage_size_bytes,), (1,), 0, torch.UntypedStorage,
                                    torch.uint8, at, msg.storage_handle, msg.storage_size_bytes,
                                    msg.storage_offset_bytes, False, msg.ref_counter_handle, msg.ref_counter_offset,
                                    msg.event_handle or None, msg.event_sync_required)
        storage = whole.untyped_storage()
        with _kept_lock:
            storage = _kept.setdefault(key, (storage, now))[0]
            while len(_kept) > KEPT_SLABS:
                _kept.popitem(last=False)
    size = torch.empty(0, dtype=dtype).element_size()
    if (msg.tensor_offset + msg.numel) * size > storage.nbytes():
        raise ValueError(f"a slab piece of {msg.numel} x {msg.dtype} at element {msg.tensor_offset} runs past its "
                         f"slab of {storage.nbytes()} bytes")
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, msg.tensor_offset, (msg.numel,), (1,))
