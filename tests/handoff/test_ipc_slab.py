"""The receiving side of CUDA IPC slab hand-offs (services/handoff/cuda_ipc.py), on the CPU: a piece is read from the
sender's slab once it is open, never past its end, and a process keeps only so many slabs open. Opening a slab and
the round trip between processes need a GPU: tests/handoff/test_cuda_ipc.py."""

from __future__ import annotations

import pytest
import torch

from services.handoff import cuda_ipc
from services.rpc import tessera_pb2 as pb


@pytest.fixture
def kept(monkeypatch):
    """A clean set of kept slabs, with one CPU storage standing for an opened slab of 4096 bytes."""
    store = cuda_ipc.OrderedDict()
    monkeypatch.setattr(cuda_ipc, "_kept", store)
    slab = torch.UntypedStorage(4096)
    torch.empty(0, dtype=torch.uint8).set_(slab, 0, (4096,), (1,)).copy_(torch.arange(4096) % 251)
    store[(b"slab-a", 0, 0)] = (slab, cuda_ipc.time.monotonic())
    return store


def piece(offset: int, numel: int, handle: bytes = b"slab-a", dtype: str = "bfloat16") -> pb.CudaIpcBuffer:
    return pb.CudaIpcBuffer(dtype=dtype, numel=numel, storage_handle=handle, storage_size_bytes=4096,
                            storage_offset_bytes=0, tensor_offset=offset, slab=True)


def test_a_piece_of_an_open_slab_is_a_view_at_its_offset(kept):
    got = cuda_ipc._slab_piece(piece(8, 100), 0, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (100,)
    want = (torch.arange(4096) % 251).to(torch.uint8)[16:216]
    assert torch.equal(got.view(torch.uint8), want)


def test_a_piece_past_the_end_of_its_slab_is_refused(kept):
    with pytest.raises(ValueError, match="runs past its slab"):
        cuda_ipc._slab_piece(piece(2000, 100), 0, torch.bfloat16)        # bytes 4000..4200 of 4096
    with pytest.raises(ValueError, match="runs past its slab"):
        cuda_ipc._slab_piece(piece(0, 1025, dtype="float32"), 0, torch.float32)


def test_the_least_recently_used_slabs_are_closed_past_the_bound(kept, monkeypatch):
    opened = []

    def rebuild(*args):
        opened.append(args[7])                     # the storage handle
        return torch.zeros(4096, dtype=torch.uint8)

    monkeypatch.setattr("torch.multiprocessing.reductions.rebuild_cuda_tensor", rebuild)
    monkeypatch.setattr(cuda_ipc, "KEPT_SLABS", 2)
    cuda_ipc._slab_piece(piece(0, 4, b"slab-b"), 0, torch.bfloat16)
    cuda_ipc._slab_piece(piece(0, 4, b"slab-a"), 0, torch.bfloat16)    # open already: nothing opened
    cuda_ipc._slab_piece(piece(0, 4, b"slab-c"), 0, torch.bfloat16)    # closes b, the least recently used
    assert opened == [b"slab-b", b"slab-c"] and [k[0] for k in kept] == [b"slab-a", b"slab-c"]
    cuda_ipc._slab_piece(piece(0, 4, b"slab-b"), 0, torch.bfloat16)    # opened again
    assert opened[-1] == b"slab-b"


def test_a_slab_no_piece_came_from_for_a_while_is_closed(kept, monkeypatch):
    monkeypatch.setattr(cuda_ipc, "KEPT_IDLE_S", 60.0)
    kept[(b"slab-a", 0, 0)] = (kept[(b"slab-a", 0, 0)][0], cuda_ipc.time.monotonic() - 50)     # last used 50 s ago
    cuda_ipc._slab_piece(piece(0, 4), 0, torch.bfloat16)            # a piece: the slab is used now
    used = kept[(b"slab-a", 0, 0)][1]
    assert cuda_ipc.time.monotonic() - used < 5
    assert cuda_ipc.close_idle_slabs(used + 30) == 0 and len(kept) == 1
    assert cuda_ipc.close_idle_slabs(used + 61) == 1 and len(kept) == 0


def test_no_slab_is_made_where_there_is_none_to_make():
    """A CPU device, or a size of 0, gives no slab (hand-offs share buffers of their own), and makes nothing."""
    assert cuda_ipc.process_ipc_slab(torch.device("cpu")) is None
    assert cuda_ipc.process_ipc_slab(torch.device("cuda", 0), 0) is None
    assert cuda_ipc._ipc_slabs == {} and cuda_ipc._no_ipc_slab == {}


def test_a_buffer_of_another_gpu_is_opened_on_the_receivers_gpu_where_it_reads_the_senders(monkeypatch):
    """Opened on the sender's GPU, a receiver makes a context there and queues its copy beside the sender's own work
    (and every other receiver's); where its GPU reads the sender's peer to peer it opens the buffer on its own."""
    peers = {(1, 0): True, (2, 0): False}
    asked = []
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: asked.append((a, b)) or peers[(a, b)])
    cuda_ipc._reads_peer.cache_clear()
    assert cuda_ipc.open_on(torch.device("cuda", 1), 0) == 1          # reads GPU 0 over NVLink: opened on GPU 1
    assert cuda_ipc.open_on(torch.device("cuda", 2), 0) == 0          # no peer access: opened where it lies
    assert cuda_ipc.open_on(torch.device("cuda", 0), 0) == 0          # the same GPU
    assert cuda_ipc.open_on(torch.device("cuda", 1), 0) == 1 and asked == [(1, 0), (2, 0)]     # asked once a pair
    cuda_ipc._reads_peer.cache_clear()


def test_a_slab_opened_on_two_gpus_is_kept_once_for_each(kept, monkeypatch):
    opened = []

    def rebuild(*args):
        opened.append((args[7], args[6]))          # (the storage handle, the GPU it is opened on)
        return torch.zeros(4096, dtype=torch.uint8)

    monkeypatch.setattr("torch.multiprocessing.reductions.rebuild_cuda_tensor", rebuild)
    cuda_ipc._slab_piece(piece(0, 4, b"slab-b"), 1, torch.bfloat16)
    cuda_ipc._slab_piece(piece(0, 4, b"slab-b"), 1, torch.bfloat16)    # kept: nothing opened
    cuda_ipc._slab_piece(piece(0, 4, b"slab-b"), 0, torch.bfloat16)    # another GPU: opened there too
    assert opened == [(b"slab-b", 1), (b"slab-b", 0)]
    assert (b"slab-b", 0, 1) in kept and (b"slab-b", 0, 0) in kept
