"""Hand-offs between workers that share one GPU: the private K/V never leave the device.

The prefill worker concatenates the request's private K/V into one device buffer and exports it
with CUDA IPC (torch.multiprocessing's reduction of a CUDA tensor; its fields travel in a
``CudaIpcBuffer`` message, not as a pickle); only the rest of the hand-off (chunk ids, positions,
logits: a few KB) goes through the gRPC stream. The decode worker opens the buffer, copies it into
its own memory on the device, closes it and only then acknowledges the push; the prefill worker
holds the buffer until that acknowledgement. Without IPC this is the gRPC path's 4-8 host copies of
every private byte, on two Python processes' CPUs.

Whether two workers share a GPU is decided from their ``WorkerStatus``: same ``host_id`` (hostname
and boot id) and same ``device_uuid``.
"""

from __future__ import annotations

import socket
from functools import lru_cache
from pathlib import Path

import torch

from services.cluster.staging import side_stream
from services.rpc import tessera_pb2 as pb


@lru_cache(maxsize=1)
def host_id() -> str:
    """This machine: hostname plus the kernel's boot id (a container reuses a hostname)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@lru_cache(maxsize=8)
def device_uuid(device: torch.device) -> str:
    """The GPU's UUID, "" for a CPU device (no IPC there)."""
    if device.type != "cuda":
        return ""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return str(getattr(torch.cuda.get_device_properties(idx), "uuid", ""))


def placement(device: torch.device) -> dict[str, str]:
    """This worker's machine and GPU, as the ``WorkerStatus`` fields ``same_gpu`` compares."""
    return {"host_id": host_id(), "device_uuid": device_uuid(device)}


def same_gpu(a: pb.WorkerStatus, b: pb.WorkerStatus) -> bool:
    return bool(a.device_uuid) and a.host_id == b.host_id and a.device_uuid == b.device_uuid


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
                            device_index=int(device), tensor_offset=int(offset))


def copy_out(msg: pb.CudaIpcBuffer) -> torch.Tensor:
    """Open a shared buffer, copy it into this process's memory on the same device, close it."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    dtype = getattr(torch, msg.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"CUDA IPC buffer of unknown dtype {msg.dtype!r}")
    # on a stream of its own: the copy waits for the sender's export event, not behind this process's
    # queued work (the decode steps its engine thread keeps issuing on the current stream)
    consumer = torch.cuda.current_stream(msg.device_index)
    side = side_stream(torch.device("cuda", msg.device_index), "ipc-copy")
    with torch.cuda.stream(side):
        shared = rebuild_cuda_tensor(torch.Tensor, (msg.numel,), (1,), msg.tensor_offset, torch.UntypedStorage,
                                     dtype, msg.device_index, msg.storage_handle, msg.storage_size_bytes,
                                     msg.storage_offset_bytes, False, msg.ref_counter_handle, msg.ref_counter_offset,
                                     msg.event_handle or None, msg.event_sync_required)
        own = shared.clone()
    side.synchronize()                  # copied before the sender may free it
    own.record_stream(consumer)         # its memory is not reused while the consumer's kernels may read it
    del shared
    return own

