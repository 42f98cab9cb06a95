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


def receive_pieces(wires: list[bytes], out, into: int | None = None, on_sender: bool = False) -> None:
    """Child process: copy out every piece named (one sender's slab, opened at the first) onto its GPU ``into`` (by
    default the slab's), send host copies back, and how many slabs this process keeps open."""
    from services.handoff import cuda_ipc
    from services.rpc import tessera_pb2 as pb

    dev = None if into is None else torch.device("cuda", into)
    got = [cuda_ipc.copy_out(pb.CudaIpcBuffer.FromString(w), dev, on_sender=on_sender) for w in wires]
    assert into is None or all(g.device.index == into for g in got)
    out.put(([g.cpu().view(torch.int16).numpy().tobytes() for g in got], len(cuda_ipc._kept)))


def slab_round_trip(sizes=(3 * 1024 * 1024 + 7, 1000, 65536), peer: bool = False, on_sender: bool = False) -> bool:
    """Share bf16 buffers of ``sizes`` through one slab (``share_from_slab``: each copied into a piece, the pieces
    lent at once) with a spawned process that copies each out; True when each arrived whole, every message named the
    slab, and the child kept one slab open. The pieces then go back, and the slab lends them again. ``peer``: the
    process is a worker of this host's second GPU and copies the pieces GPU to GPU, the slab opened on its own GPU
    (``cuda_ipc.open_on``), or with ``on_sender`` on the slab's."""
    from services.handoff.cuda_ipc import IpcSlab, gpu_order, share_from_slab
    from services.launch.local import child_gpus, visible_gpus

    slab = IpcSlab(64 << 20, torch.device("cuda:0"))
    bufs = [torch.randn(n, device="cuda:0", dtype=torch.bfloat16) for n in sizes]
    shared = [share_from_slab(b, slab) for b in bufs]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=receive_pieces, args=([m.SerializeToString() for _, m in shared], q,
                                                  0 if peer else None, on_sender))
    visible = visible_gpus()
    with child_gpus(gpu_order(visible[1], visible) if peer else None):
        p.start()
    got, kept = q.get(timeout=120)
    p.join(60)
    ok = (p.exitcode == 0 and kept == 1 and all(m.slab and piece is not None for piece, m in shared)
          and all(g == b.cpu().view(torch.int16).numpy().tobytes() for g, b in zip(got, bufs)))
    for piece, _ in shared:
        slab.give(piece)
    return ok and slab.taken == 0 and slab.take(64 << 20) is not None


if __name__ == "__main__":
    print("cuda ipc slab round trip:", "ok" if slab_round_trip() else "MISMATCH")
    print("cuda ipc round trip:", "ok" if round_trip() else "MISMATCH")
    if torch.cuda.device_count() > 1:
        print("cuda ipc round trip, GPU to GPU:", "ok" if round_trip(peer=True) else "MISMATCH")
        print("cuda ipc slab round trip, GPU to GPU, opened on the receiver's GPU:",
              "ok" if slab_round_trip(peer=True) else "MISMATCH")
        print("cuda ipc slab round trip, GPU to GPU, opened on the sender's GPU:",
              "ok" if slab_round_trip(peer=True, on_sender=True) else "MISMATCH")
