"""Where a decode worker lands a hand-off's K/V read over NIXL (services/decode/server.py ``_read_nixl``): on its
engine's device; where NIXL cannot take that memory, in host memory from then on; a damaged or failed transfer is
the caller's DATA_LOSS (a RuntimeError), never a crash. NIXL itself is replaced here (it loads in child processes
only: tests/handoff/test_nixl.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.handoff import nixl
from services.rpc import tessera_pb2 as pb


def _servicer(device: str):
    from services.decode.server import DecodeServicer

    s = DecodeServicer.__new__(DecodeServicer)
    s.name, s.eng = "decode-test", SimpleNamespace(device=torch.device(device))
    s.settings = SimpleNamespace(handoff_wait_s=1.0, nixl_slab_bytes=1 << 20)
    s._nixl_device_ok = True
    return s


def _msg():
    offer = nixl.Offer("sender", b"meta", b"descs", 16, 0)
    return pb.NixlBuffer(offer=offer.to_bytes(), dtype="float32", numel=4)


@pytest.fixture
def reads(monkeypatch):
    """Every read_via_slab call's device; ``fail`` maps a device type to the error a read there raises."""
    seen, fail = [], {}

    def read(endpoint, offer, dtype, numel, device, timeout, notify=b"", slab_bytes=None):
        assert slab_bytes == 1 << 20                     # the worker's setting
        seen.append(torch.device(device).type)
        if torch.device(device).type in fail:
            raise fail[torch.device(device).type]
        return torch.arange(numel, dtype=dtype)

    monkeypatch.setattr(nixl, "read_via_slab", read)
    monkeypatch.setattr(nixl, "process_endpoint", lambda: None)
    return seen, fail


def test_a_device_nixl_cannot_take_falls_back_to_host_memory_once_and_for_all(reads):
    seen, fail = reads
    s = _servicer("cuda")               # no GPU needed: the read is replaced
    fail["cuda"] = KeyError("nixlBackendError: cannot register VRAM")          # not a transfer failure
    assert torch.equal(s._read_nixl(_msg()), torch.arange(4, dtype=torch.float32))
    assert seen == ["cuda", "cpu"] and not s._nixl_device_ok
    s._read_nixl(_msg())
    assert seen == ["cuda", "cpu", "cpu"]                                       # host memory from then on


def test_a_failed_transfer_is_data_loss_and_changes_nothing(reads):
    seen, fail = reads
    s = _servicer("cuda")
    fail["cuda"] = nixl.TransferFailed("the bytes read from sender fail the offer's checksum")
    with pytest.raises(RuntimeError, match="fail the offer's checksum"):
        s._read_nixl(_msg())
    assert seen == ["cuda"] and s._nixl_device_ok                               # damage is not a memory problem
    fail["cpu"] = KeyError("unreachable")
    s = _servicer("cpu")
    with pytest.raises(RuntimeError, match="NIXL read failed"):
        s._read_nixl(_msg())


def test_malformed_buffers_are_refused(reads):
    s = _servicer("cpu")
    with pytest.raises(ValueError, match="dtype"):
        s._read_nixl(pb.NixlBuffer(offer=_msg().offer, dtype="nonsense", numel=4))
    with pytest.raises(ValueError):
        s._read_nixl(pb.NixlBuffer(offer=b"garbage", dtype="float32", numel=4))
