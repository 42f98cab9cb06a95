"""A client's read-only maps of its host's store arena segments (``arena.Arena``), registered with CUDA once each.

The first read from a segment maps it; with ``pin`` (a GPU's worker) a background thread then registers the map with
CUDA for the GPU that read it (read-only: ~35-50 ms a GiB on an H100 host), after which copies from it to that GPU run
at the pinned host-to-device rate with no staging copy. Until then the same views copy as pageable memory,
synchronously, as do copies to another GPU. Registering "portable" (for every GPU the process sees, as a worker of a
four-GPU host sees four) is what it did before, and cost a worker seconds of a replay: ``bench/kvstore/register.py``
times both. The
first segment of a directory also queues every other segment already there (``seg-*``): a worker meets the arena
at its first read and registers the whole of it then, in the background, instead of one segment at a time as its
reads reach them while it serves (eight workers of a four-GPU host registering 32 GiB each were seen doing so for
seconds into a replay). A segment file replaced under the same name (the store restarted) is mapped again; the old
map is dropped."""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from services.kvstore.arena import GENERATION_AT

log = logging.getLogger(__name__)

_READ_ONLY = 8                      # cudaHostRegisterReadOnly


class Segment:
    def __init__(self, path: str, fd: int, ident: tuple[int, int], size: int) -> None:
        self.path, self.ident, self.size = path, ident, size
        self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        self.array = np.frombuffer(self.map, dtype=np.uint8)
        with warnings.catch_warnings():         # read-only memory: views of it are only ever copied from
            warnings.simplefilter("ignore", UserWarning)
            self.bytes = torch.from_numpy(self.array)
        self.registered: Future | None = None

    @property
    def pinned(self) -> bool:
        return self.registered is not None and self.registered.done() and self.registered.result()

    def header(self, offset: int) -> int:
        """The generation in the extent header at ``offset`` (arena.GENERATION_AT)."""
        return int(self.array[offset + GENERATION_AT: offset + GENERATION_AT + 8].view(np.uint64)[0])

    def holds(self, t: torch.Tensor) -> bool:
        start = self.array.ctypes.data
        return start <= t.data_ptr() < start + self.size

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.array.ctypes.data)
        self.registered = None
        del self.bytes, self.array
        try:
            self.map.close()
        except BufferError:     # a view is still held somewhere: the map goes when it does
            pass


class SharedSegments:
    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._maps: dict[str, Segment] = {}
        self._lock = threading.Lock()
        self._registrar: ThreadPoolExecutor | None = None
        self._met: set[str] = set()         # directories whose other segments were queued
        self.device: int | None = None      # the GPU registrations are for: the first reader's current one
        self.registered_bytes = 0
        self.register_seconds = 0.0         # spent in cudaHostRegister, summed

    def open(self, path: str) -> Segment:
        """The map of the segment file now at ``path`` (FileNotFoundError when there is none)."""
        st = os.stat(path)
        with self._lock:
            seg = self._maps.get(path)
            if seg is not None and seg.ident == (st.st_dev, st.st_ino):
                return seg
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            ident = (st.st_dev, st.st_ino)
            with self._lock:
                seg = self._maps.get(path)
                if seg is not None and seg.ident == ident:
                    return seg
                if seg is not None:
                    seg.close()
                seg = self._maps[path] = Segment(path, fd, ident, st.st_size)
                if self.pin:
                    if self.device is None:
                        self.device = torch.cuda.current_device()
                    if self._registrar is None:
                        self._registrar = ThreadPoolExecutor(1, thread_name_prefix="kv-segment-pin")
                    seg.registered = self._registrar.submit(self._register, seg)
                    directory = os.path.dirname(path)
                    if directory not in self._met:
                        self._met.add(directory)
                        self._registrar.submit(self._meet, directory)
                return seg
        finally:
            os.close(fd)

    def _meet(self, directory: str) -> None:
        """Map (and so register, queued behind) every segment file of ``directory`` not mapped yet."""
        try:
            names = sorted(n for n in os.listdir(directory) if n.startswith("seg-"))
        except OSError:
            return
        for name in names:
            try:
                self.open(os.path.join(directory, name))
            except OSError:         # gone meanwhile, or not ours to read: its first read says so
                pass

    def _register(self, seg: Segment) -> bool:
        torch.cuda.set_device(self.device)        # this thread's registrations are for the reader's GPU
        cudart = torch.cuda.cudart()
        for flags in (_READ_ONLY, 0):
            t0 = time.perf_counter()
            done = int(cudart.cudaHostRegister(seg.array.ctypes.data, seg.size, flags)) == 0
            self.register_seconds += time.perf_counter() - t0
            if done:
                self.registered_bytes += seg.size
                return True
        log.warning("could not register %s with CUDA: its chunks copy to the GPU as pageable memory", seg.path)
        return False

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a view of a mapped segment (memory the store may reuse after its grace: copy it to keep it)."""
        with self._lock:
            return any(seg.holds(t) for seg in self._maps.values())

    def close(self) -> None:
        if self._registrar is not None:
            self._registrar.shutdown(wait=True)
        with self._lock:
            for seg in self._maps.values():
                seg.close()
            self._maps.clear()
