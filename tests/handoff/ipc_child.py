"""The two sides of the CUDA IPC hand-off check, importable without pytest (the spawned child imports
this module by name, and the GPU host that runs the check may have no pytest)."""

from __future__ import annotations

import multiprocessing as mp

import torch


def receive(wire: bytes, out, into: int | None = None) -> None:
    """Child process: open the shared buffer, copy it out (onto its GPU ``into``: by default the buffer's), send a
    host copy back."""
    from services.handoff.cuda_ipc import copy_out
    from services.rpc import tessera_pb2 as pb

    got = copy_out(pb.CudaIpcBuffer.FromString(wire), None if into is None else torch.device("cuda", into))
    assert into is None or got.device.index == into
    got = got.cpu()
    # plain bytes back, not a tensor: a tensor would be shared by a file descriptor that this process,
    # about to exit, could no longer hand over
    out.put(got.view(torch.int16).numpy().tobytes())


def round_trip(n: int = 3 * 1024 * 1024 + 7, offset: int = 5, peer: bool = False) -> bool:
    """Share a bf16 CUDA buffer that starts ``offset`` elements into its allocation with a spawned
    process; True when what it copied out equals the original. ``peer``: the process is a worker of this
    host's second GPU (it sees that GPU first, as the launcher starts one) and copies the buffer GPU to GPU."""
    from services.handoff.cuda_ipc import gpu_order, share
    from services.launch.local import child_gpus, visible_gpus

    src = torch.randn(n, device="cuda:0", dtype=torch.bfloat16)
    buf = src[offset:]                 # the offset inside the allocation must travel too
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=receive, args=(share(buf).SerializeToString(), q, 0 if peer else None))
    visible = visible_gpus()
    # peer: the child's cuda:0 is this process's cuda:1; this one's cuda:0 is its cuda:1
    with child_gpus(gpu_order(visible[1], visible) if peer else None):
        p.start()
    got = q.get(timeout=120)
    p.join(60)
    return p.exitcode == 0 and got == buf.cpu().view(torch.int16).numpy().tobytes()


if __name__ == "__main__":
    print("cuda ipc round trip:", "ok" if round_trip() else "MISMATCH")
    if torch.cuda.device_count() > 1:
        print("cuda ipc round trip, GPU to GPU:", "ok" if round_trip(peer=True) else "MISMATCH")
