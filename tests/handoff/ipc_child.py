"""The two sides of the CUDA IPC hand-off check, importable without pytest (the spawned child imports
this module by name, and the GPU host that runs the check may have no pytest)."""

from __future__ import annotations

import multiprocessing as mp

import torch


def receive(wire: bytes, out) -> None:
    """Child process: open the shared buffer, copy it out, send a host copy back."""
    from services.handoff.cuda_ipc import copy_out
    from services.rpc import tessera_pb2 as pb

    got = copy_out(pb.CudaIpcBuffer.FromString(wire)).cpu()
    # plain bytes back, not a tensor: a tensor would be shared by a file descriptor that this process,
    # about to exit, could no longer hand over
    out.put(got.view(torch.int16).numpy().tobytes())


def round_trip(n: int = 3 * 1024 * 1024 + 7, offset: int = 5) -> bool:
    """Share a bf16 CUDA buffer that starts ``offset`` elements into its allocation with a spawned
    process; True when what it copied out equals the original."""
    from services.handoff.cuda_ipc import share

    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    buf = src[offset:]                 # the offset inside the allocation must travel too
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=receive, args=(share(buf).SerializeToString(), q))
    p.start()
    got = q.get(timeout=120)
    p.join(60)
    return p.exitcode == 0 and got == buf.cpu().view(torch.int16).numpy().tobytes()


if __name__ == "__main__":
    print("cuda ipc round trip:", "ok" if round_trip() else "MISMATCH")
