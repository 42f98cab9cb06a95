"""Copies between host and GPU that stay off the engine's stream.

A worker's helper threads move chunk KV while its engine thread computes. A plain ``.cpu()`` or
``.to(cuda)`` there runs on the engine's stream (in line with its kernels), and a copy from pageable
memory first waits for that stream to drain. ``copy_aside`` copies through pinned memory on a side
stream instead and returns the event that marks the copies done.
"""

from __future__ import annotations

import torch

_STREAMS: dict[tuple[str, torch.device], torch.cuda.Stream] = {}


def side_stream(device, purpose: str = "staging") -> torch.cuda.Stream:
    """This process's side stream on a GPU for one purpose (made on first use): helper threads queue
    their copies there, apart from the engine's stream and from each other purpose's copies."""
    key = (purpose, torch.device(device))
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(key[1])
    return _STREAMS[key]


def copy_aside(tensors: list[torch.Tensor], device: torch.device) -> tuple[list[torch.Tensor], torch.cuda.Event]:
    """``tensors`` copied to ``device`` on a side stream: to the CPU into pinned memory, after the
    current stream's work on the GPU sources (marked used by the side stream, so the caller may drop
    them at once); to a GPU from host tensors. Wait on the returned event before reading the copies,
    and ``record_stream`` GPU copies on the stream that reads them."""
    gpu = device if device.type == "cuda" else tensors[0].device
    stream = side_stream(gpu)
    if device.type != "cuda":     # GPU sources: after the kernels that wrote them
        stream.wait_stream(torch.cuda.current_stream(gpu))
    out = []
    with torch.cuda.stream(stream):
        if device.type == "cuda":
            out = [t.pin_memory().to(device, non_blocking=True) for t in tensors]
        else:
            for t, dst in zip(tensors, pinned_like(tensors)):
                dst.copy_(t, non_blocking=True)
                t.record_stream(stream)
                out.append(dst)
    ready = torch.cuda.Event()
    ready.record(stream)
    return out, ready


def pinned_like(tensors: list[torch.Tensor], pin: bool = True) -> list[torch.Tensor]:
    """Empty host tensors shaped as ``tensors`` (pinned unless ``pin`` is False): views of one allocation a dtype, not
    one each. A chunk's 64 layer tensors took 64 trips through the pinned allocator (its lock, its events, a
    cudaHostAlloc whenever no cached block fits), and that was a fifth of a prefill engine's samples in a py-spy
    recording of the cluster (bench/cluster/README.md). The views keep the allocation alive until the last of them
    goes."""
    sizes: dict[torch.dtype, int] = {}
    for t in tensors:
        sizes[t.dtype] = sizes.get(t.dtype, 0) + t.numel()
    flat = {dtype: torch.empty(n, dtype=dtype, pin_memory=pin) for dtype, n in sizes.items()}
    at = dict.fromkeys(sizes, 0)
    out = []
    for t in tensors:
        n = t.numel()
        out.append(flat[t.dtype][at[t.dtype]:at[t.dtype] + n].view(t.shape))
        at[t.dtype] += n
    return out
