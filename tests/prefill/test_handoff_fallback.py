"""A zero-copy hand-off (NIXL, CUDA IPC) the decode worker cannot take goes by the gRPC stream instead, and so do the
prefill worker's next ones to that worker for a while; any other failure is ABORTED (the gateway tries another)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import torch
import pytest

from services.handoff.transport import TransportChoice
from services.prefill import server as prefill_server
from services.prefill.metrics import PrefillMetrics
from services.rpc import tessera_pb2 as pb


class FakeHandoff:
    """What _push reads of an engine hand-off: its layers, its K/V buffer, its bytes with or without the K/V."""

    layers = [object()]
    ready = None

    def kv_buffer(self):
        return torch.arange(12, dtype=torch.float32)

    def to_bytes(self, with_kv: bool = True) -> bytes:
        return b"rest" + (b"+kv" * 100 if with_kv else b"")


class Aborted(Exception):
    pass


class Context:
    def time_remaining(self):
        return 30.0

    async def abort(self, code, details):
        raise Aborted(code, details)


class Decode:
    """A decode worker's stub: answers each push with the next of ``replies`` (None: ok, else a status code)."""

    def __init__(self, replies):
        self.replies, self.pushes = list(replies), []

    async def Status(self, request, timeout):
        return pb.WorkerStatus(host_id="another-host/1", device_uuid="GPU-x")     # no CUDA IPC to it

    async def PushHandoff(self, parts, timeout):
        parts = list(parts)
        header = parts[0].header
        self.pushes.append((header, b"".join(p.data for p in parts[1:])))
        code = self.replies.pop(0)
        if code is not None:
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "cannot read it")
        return pb.HandoffAck()


def servicer(decode: Decode, offered: list, released: list):
    s = prefill_server.PrefillServicer.__new__(prefill_server.PrefillServicer)
    s.name, s.transport = "prefill-test", TransportChoice("nixl", "nixl (test)")
    s.ipc_slab_bytes = None
    s._stream_only, s._ipc = {}, {}
    s.io_threads = ThreadPoolExecutor(1)
    s.worker = SimpleNamespace(metrics=PrefillMetrics(), eng=SimpleNamespace(device=torch.device("cpu")))
    s._decode_stub = lambda address: decode

    def offer(kv, header):
        offered.append(kv)
        header.nixl.CopyFrom(pb.NixlBuffer(offer=b"offer", dtype="float32", numel=kv.numel()))
        return kv

    s._offer_nixl = offer
    s._nixl_release = released.append
    return s


def push(s, request_id="r1"):
    out = SimpleNamespace(handoff=FakeHandoff(), first_token=3, storing=[])
    return asyncio.run(s._push(out, request_id, "decode-0:1", Context()))


def test_a_nixl_read_the_decode_worker_refuses_goes_by_the_stream_and_the_next_ones_too():
    decode, offered, released = Decode([grpc.StatusCode.DATA_LOSS, None, None]), [], []
    s = servicer(decode, offered, released)
    moved, used = push(s)
    assert used == "grpc" and len(decode.pushes) == 2
    (first, first_payload), (second, second_payload) = decode.pushes
    assert first.HasField("nixl") and first_payload == FakeHandoff().to_bytes(with_kv=False)
    assert not second.HasField("nixl") and not second.HasField("kv")
    assert second_payload == FakeHandoff().to_bytes() and moved == len(second_payload)
    assert len(released) == 1 and released[0] is offered[0]        # what the offer named, given back
    # the next hand-off to that worker goes straight by the stream: nothing offered
    assert push(s, "r2") == (len(FakeHandoff().to_bytes()), "grpc")
    assert len(offered) == 1 and len(decode.pushes) == 3 and not decode.pushes[2][0].HasField("nixl")
    # after the pause, zero-copy again
    s._stream_only["decode-0:1"] = 0.0
    decode.replies.append(None)
    assert push(s, "r3")[1] == "nixl" and len(offered) == 2 and len(released) == 2


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED])
def test_other_failures_abort_and_keep_zero_copy(code):
    decode, offered, released = Decode([code]), [], []
    s = servicer(decode, offered, released)
    with pytest.raises(Aborted) as err:
        push(s)
    assert err.value.args[0] == grpc.StatusCode.ABORTED and "decode-0:1" in err.value.args[1]
    assert len(decode.pushes) == 1 and released == offered and s._stream_only == {}


def test_a_stream_hand_off_that_fails_is_not_sent_twice():
    decode = Decode([grpc.StatusCode.DATA_LOSS])
    s = servicer(decode, [], [])
    s.transport = TransportChoice("grpc", "grpc stream (test)")
    with pytest.raises(Aborted):
        push(s)
    assert len(decode.pushes) == 1 and s._stream_only == {}


def test_a_cuda_ipc_buffer_the_decode_worker_cannot_open_goes_by_the_stream(monkeypatch):
    decode = Decode([grpc.StatusCode.DATA_LOSS, None])
    s = servicer(decode, [], [])
    s.transport = TransportChoice("cuda-ipc", "cuda-ipc (test)")
    s._ipc["decode-0:1"] = "peer"                     # another GPU of this host, which it turns out not to see
    monkeypatch.setattr(prefill_server, "process_ipc_slab", lambda device, nbytes: None)
    monkeypatch.setattr(prefill_server, "share_from_slab",
                        lambda kv, slab: (None, pb.CudaIpcBuffer(dtype="float32", numel=kv.numel())))
    moved, used = push(s)
    (first, _), (second, second_payload) = decode.pushes
    assert first.HasField("kv") and not second.HasField("kv") and used == "grpc"
    assert second_payload == FakeHandoff().to_bytes() and "decode-0:1" in s._stream_only


@pytest.mark.parametrize("replies, used", [([None], "cuda-ipc-peer"), ([grpc.StatusCode.DATA_LOSS, None], "grpc"),
                                           ([grpc.StatusCode.UNAVAILABLE], None)],
                         ids=["taken", "refused-then-streamed", "failed"])
def test_a_hand_off_from_a_piece_of_the_ipc_slab_gives_the_piece_back_however_the_push_ends(monkeypatch, replies,
                                                                                          used):
    from services.handoff.slab import Slab

    slab = Slab(1 << 16)
    decode = Decode(replies)
    s = servicer(decode, [], [])
    s.transport = TransportChoice("cuda-ipc", "cuda-ipc (test)")
    s._ipc["decode-0:1"] = "peer"
    lent = []

    def from_slab(kv, given):
        piece = given.take(kv.numel() * kv.element_size())
        piece.copy_(kv.view(torch.uint8))
        lent.append(piece)
        return piece, pb.CudaIpcBuffer(dtype="float32", numel=kv.numel(), slab=True)

    monkeypatch.setattr(prefill_server, "process_ipc_slab", lambda device, nbytes: slab)
    monkeypatch.setattr(prefill_server, "share_from_slab", from_slab)
    if used is None:
        with pytest.raises(Aborted):
            push(s)
    else:
        assert push(s)[1] == used
    assert decode.pushes[0][0].kv.slab and len(lent) == 1
    assert torch.equal(lent[0].view(torch.float32), FakeHandoff().kv_buffer())
    assert slab.taken == 0 and slab.free_bytes == 1 << 16        # the piece went back


def test_nixl_that_cannot_offer_this_workers_memory_is_dropped_and_stats_say_why(monkeypatch):
    """A NIXL whose UCX cannot register this worker's memory (one built for another CUDA, seen on a CUDA 13 host with
    nixl-cu12: "VRAM memory is detected as host") fails every offer: the hand-off goes by the stream, later ones do
    not try NIXL again, and the transport the worker reports names the cause."""
    from services.handoff import nixl

    decode, released = Decode([None, None]), []
    s = prefill_server.PrefillServicer.__new__(prefill_server.PrefillServicer)
    s.name, s.transport = "prefill-test", TransportChoice("nixl", "nixl (test)")
    s.ipc_slab_bytes, s.nixl_slab_bytes = None, None
    s._stream_only, s._ipc = {}, {}
    s.io_threads = ThreadPoolExecutor(1)
    s.worker = SimpleNamespace(metrics=PrefillMetrics(), eng=SimpleNamespace(device=torch.device("cpu")))
    s._decode_stub = lambda address: decode
    s._nixl_release = released.append
    tried = []

    def refuse(endpoint, kv, slab_bytes=None):
        tried.append(kv)
        raise RuntimeError("NIXL_ERR_BACKEND: VRAM memory is detected as host by UCX")

    monkeypatch.setattr(nixl, "offer_from_slab", refuse)
    monkeypatch.setattr(nixl, "process_endpoint", lambda: object())
    assert push(s) == (len(FakeHandoff().to_bytes()), "grpc")
    assert len(tried) == 1 and not decode.pushes[0][0].HasField("nixl") and released == []
    assert s.transport.name == "grpc" and "could not offer" in s.transport.detail
    assert "VRAM memory is detected as host" in s.transport.detail
    assert push(s, "r2") == (len(FakeHandoff().to_bytes()), "grpc") and len(tried) == 1     # not tried again
