"""A worker's maps of its host's store arena (``kvstore.segments``): it watches the arena's directory and registers
every segment as it appears, so that registering does not follow its reads through a replay."""

import os
import time

import pytest
import torch

from services.kvstore.segments import SharedSegments


@pytest.fixture(autouse=True)
def _no_cuda_unregister(monkeypatch):
    """A pinned map is unregistered when closed; here nothing was registered with CUDA (registering is stubbed)."""
    monkeypatch.setattr(torch.cuda, "cudart", lambda: type("R", (), dict(cudaHostUnregister=lambda self, ptr: 0))())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def _arena(tmp_path, n: int, size: int = 1 << 16):
    for i in range(n):
        with open(tmp_path / f"seg-{i:04d}", "wb") as f:
            f.truncate(size)
    (tmp_path / "not-a-segment").write_bytes(b"x")
    return [str(tmp_path / f"seg-{i:04d}") for i in range(n)]


def _until(check, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return check()


def test_the_first_segment_read_registers_every_segment_of_its_arena_and_those_made_later(tmp_path, monkeypatch):
    paths = _arena(tmp_path, 4)
    registered = []

    def register(self, seg):
        registered.append(seg.path)
        self.registered_bytes += seg.size
        return True

    monkeypatch.setattr(SharedSegments, "_register", register)
    segs = SharedSegments(pin=True)
    try:
        first = segs.open(paths[2])
        assert _until(lambda: len(registered) == 4)
        assert sorted(registered) == sorted(paths)                   # each once, the stray file not
        assert _until(lambda: first.pinned) and segs.registered_bytes == 4 << 16
        assert segs.open(paths[0]).pinned                            # already mapped: the same map, no new work
        with open(tmp_path / "seg-0004", "wb") as f:                 # the store's arena grows
            f.truncate(1 << 16)
        assert _until(lambda: len(registered) == 5) and registered[-1] == str(tmp_path / "seg-0004")
    finally:
        segs.close()
    assert len(registered) == 5 and not any(t.is_alive() for t in segs._watched.values())


def test_a_lookup_naming_the_arena_starts_the_watch_before_any_read(tmp_path, monkeypatch):
    paths = _arena(tmp_path, 2)
    registered = []
    monkeypatch.setattr(SharedSegments, "_register", lambda self, seg: registered.append(seg.path) or True)
    segs = SharedSegments(pin=True)
    try:
        segs.watch(str(tmp_path))
        segs.watch(str(tmp_path))                                    # once per directory
        assert _until(lambda: sorted(registered) == sorted(paths)) and len(segs._watched) == 1
    finally:
        segs.close()


def test_without_pinning_only_what_is_read_is_mapped(tmp_path):
    paths = _arena(tmp_path, 3)
    segs = SharedSegments(pin=False)
    try:
        seg = segs.open(paths[1])
        assert seg.registered is None and segs._registrar is None and list(segs._maps) == [paths[1]]
    finally:
        segs.close()


def test_a_segment_that_vanishes_before_the_arena_is_met_is_skipped(tmp_path, monkeypatch):
    paths = _arena(tmp_path, 3)
    monkeypatch.setattr(SharedSegments, "_register", lambda self, seg: True)
    real_listdir = os.listdir

    def listdir(d):
        names = real_listdir(d)
        if os.path.exists(paths[2]):
            os.unlink(paths[2])      # gone between the listing and its map
        return names

    monkeypatch.setattr(os, "listdir", listdir)
    segs = SharedSegments(pin=True)
    try:
        segs.open(paths[0])
        assert _until(lambda: sorted(segs._maps) == sorted(paths[:2]))
        time.sleep(0.1)
        assert sorted(segs._maps) == sorted(paths[:2])
    finally:
        segs.close()


def test_a_segment_is_registered_read_only_for_the_readers_gpu_not_for_every_gpu(tmp_path, monkeypatch):
    """Portable registration maps a segment for every GPU the process sees (a worker of a four-GPU host sees four)
    and cost workers seconds of a replay; the reader's GPU alone is asked for, made current on the registering
    thread. A driver that refuses read-only gets a plain registration."""
    paths = _arena(tmp_path, 1)
    calls, devices = [], []

    class Cudart:
        def __init__(self, refuse):
            self.refuse = refuse

        def cudaHostRegister(self, ptr, size, flags):
            calls.append(flags)
            return 1 if flags in self.refuse else 0

        def cudaHostUnregister(self, ptr):
            return 0

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    for refuse, want in (((), [8]), ((8,), [8, 0])):
        calls.clear()
        monkeypatch.setattr(torch.cuda, "cudart", lambda refuse=refuse: Cudart(refuse))
        segs = SharedSegments(pin=True)
        try:
            seg = segs.open(paths[0])
            assert seg.registered.result(timeout=30) is True
            assert calls == want and not any(f & 1 for f in calls)        # never cudaHostRegisterPortable
            assert segs.device == 3 and devices[-1] == 3 and segs.registered_bytes == 1 << 16
        finally:
            segs.close()
