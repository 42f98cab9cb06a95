"""Hand-off transport: framing and its checks, the transport probe, CUDA IPC's one-GPU rule."""

from __future__ import annotations

import asyncio

import pytest

from services.handoff.transport import HandoffError, handoff_parts, probe_transport, receive_handoff
from services.rpc import tessera_pb2 as pb


@pytest.mark.parametrize("n", [0, 10, (1 << 20) + 5])
def test_handoff_parts_round_trip(n):
    payload = bytes(i % 251 for i in range(n))

    async def collect(parts):
        async def gen():
            for p in parts:
                yield p
        return await receive_handoff(gen())

    parts = list(handoff_parts(pb.HandoffHeader(request_id="r", kind="engine"), payload))
    assert all(len(p.data) <= 1 << 20 for p in parts[1:])
    got = asyncio.run(collect(parts))
    assert got.payload == payload and got.header.request_id == "r"


def test_damaged_handoff_is_refused():
    parts = list(handoff_parts(pb.HandoffHeader(request_id="r", kind="engine"), b"x" * 100))
    parts[1] = pb.HandoffPart(data=b"y" * 100)

    async def run(ps):
        async def gen():
            for p in ps:
                yield p
        return await receive_handoff(gen())

    with pytest.raises(HandoffError, match="bad crc32"):
        asyncio.run(run(parts))
    with pytest.raises(HandoffError, match="must start with its header"):
        asyncio.run(run(parts[1:]))


def test_transport_probe_reports_nixl():
    choice = probe_transport()
    assert choice.name == "grpc" and "nixl" in choice.detail
    import torch
    assert probe_transport(torch.device("cpu")).name == "grpc"
    assert probe_transport(torch.device("cuda", 0)).name == "cuda-ipc"   # a probe only: touches no GPU


def test_nixl_is_used_where_asked_for_and_loadable_else_the_stream_says_why(monkeypatch):
    import torch

    from services.handoff import nixl

    assert probe_transport(torch.device("cpu"), "nixl").name == "nixl"
    assert probe_transport(torch.device("cpu"), "grpc").name == "grpc"
    gpu = probe_transport(torch.device("cuda", 0), "nixl")
    assert gpu.name == "nixl" and "cuda-ipc" in gpu.detail      # one GPU shared: CUDA IPC still

    def missing():
        raise nixl.NixlUnavailable("no NIXL package is installed (test)")

    monkeypatch.setattr(nixl, "nixl_module", missing)
    choice = probe_transport(torch.device("cpu"), "nixl")
    assert choice.name == "grpc" and "nixl asked for but unavailable: no NIXL package" in choice.detail


def test_cuda_ipc_needs_one_host_and_a_gpu_the_receiver_sees():
    import torch

    from services.handoff.cuda_ipc import (device_uuid, gpu_order, host_id, ipc_reaches, local_index, placement,
                                           same_gpu, share)
    me = pb.WorkerStatus(host_id=host_id(), device_uuid="GPU-1")
    assert same_gpu(me, pb.WorkerStatus(host_id=host_id(), device_uuid="GPU-1"))
    assert not same_gpu(me, pb.WorkerStatus(host_id=host_id(), device_uuid="GPU-2"))
    assert not same_gpu(me, pb.WorkerStatus(host_id="elsewhere/1", device_uuid="GPU-1"))
    assert not same_gpu(pb.WorkerStatus(host_id=host_id(), device_uuid=""),
                        pb.WorkerStatus(host_id=host_id(), device_uuid=""))   # CPU workers
    assert device_uuid(torch.device("cpu")) == ""
    assert placement(torch.device("cpu")) == {"host_id": host_id(), "device_uuid": "", "ipc_gpus": []}
    # another GPU of the host: only when the receiver's process sees it
    peer = pb.WorkerStatus(host_id=host_id(), device_uuid="GPU-2", ipc_gpus=["GPU-2", "GPU-1"])
    assert ipc_reaches(me, peer) and not same_gpu(me, peer)
    assert not ipc_reaches(me, pb.WorkerStatus(host_id=host_id(), device_uuid="GPU-2", ipc_gpus=["GPU-2"]))
    assert not ipc_reaches(me, pb.WorkerStatus(host_id="elsewhere/1", device_uuid="GPU-2", ipc_gpus=["GPU-1"]))
    assert ipc_reaches(me, pb.WorkerStatus(host_id=host_id(), device_uuid="GPU-1"))   # a peer of before ipc_gpus
    assert not ipc_reaches(pb.WorkerStatus(host_id=host_id()), pb.WorkerStatus(host_id=host_id(), ipc_gpus=[""]))
    # a worker's process sees its own GPU first, then the others
    assert gpu_order("2", ["0", "1", "2", "3"]) == "2,0,1,3" and gpu_order("0", ["0"]) == "0"
    with pytest.raises(ValueError, match="not among the visible GPUs"):
        gpu_order("5", ["0", "1"])
    assert local_index("", 3) == 3      # a sender of before device_uuid: its own index
    with pytest.raises(ValueError, match="does not see"):
        local_index("GPU-not-here", 0)
    with pytest.raises(ValueError, match="CUDA tensor"):
        share(torch.zeros(4))


def test_nixl_that_failed_here_is_chosen_no_more_and_the_choice_says_why():
    import torch

    gpu = probe_transport(torch.device("cuda", 0), "nixl", nixl_failed="it could not offer this worker's memory: X")
    cpu = probe_transport(torch.device("cpu"), "nixl", nixl_failed="it could not offer this worker's memory: X")
    assert gpu.name == "cuda-ipc" and cpu.name == "grpc"
    for choice in (gpu, cpu):
        assert "nixl asked for, but it could not offer this worker's memory: X" in choice.detail
