"""The CUDA IPC hand-off path between two processes on one GPU (skipped without CUDA; run on a GPU host)."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _receiver(wire: bytes, out) -> None:
    from services.cluster.cuda_ipc import copy_out
    from services.rpc import tessera_pb2 as pb

    buf = copy_out(pb.CudaIpcBuffer.FromString(wire))
    out.put(buf.cpu())


def test_a_buffer_shared_with_another_process_arrives_whole():
    from services.cluster.cuda_ipc import share

    src = torch.randn(3 * 1024 * 1024 + 7, device="cuda", dtype=torch.bfloat16)
    view = src[5:]                      # an offset inside its allocation: the offset must travel too
    buf = view.contiguous() if not view.is_contiguous() else view
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_receiver, args=(share(buf).SerializeToString(), q))
    p.start()
    got = q.get(timeout=120)
    p.join(60)
    assert p.exitcode == 0
    assert torch.equal(got, buf.cpu())
