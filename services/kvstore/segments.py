"""A client's read-only maps of its host's store arena segments (``arena.Arena``), registered with CUDA once each.

The first read from a segment maps it; with ``pin`` (a GPU's worker) a background thread then registers the map with
CUDA for the GPU that read it (read-only: ~35-50 ms a GiB on an H100 host), after which copies from it to that GPU run
at the pinned host-to-device rate with no staging copy. Until then the same views copy as pageable memory,
synchronously, as do copies to another GPU. Registering costs ~90-160 ms a GiB on a four-GPU H200 host
(``bench/kvstore/register.py``), so a worker that met a 30 GiB arena at its first read spent seconds registering while
it served. It therefore watches the arena's directory instead, from its first lookup (the store names the directory:
``LookupResponse.arena_directory``) or its first read, whichever comes first: every segment file there is mapped and
registered in the background as it appears, as the store's arena grows, ahead of the reads. A segment file replaced
under the same name (the store restarted) is mapped again; the old map is dropped."""

from __future__ import annotations

import logging
import mmap
import os
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from services.kvstore.arena import GENERATION_AT

log = logging.getLogger(__name__)

_READ_ONLY = 8                      # cudaHostRegisterReadOnly
WATCH_S = 1.0                       # how often a watched arena directory is listed for new segments


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
        self._watched: dict[str, threading.Thread] = {}     # directory -> the thread mapping its new segments
        self._closing = threading.Event()
        self.device: int | None = None      # the GPU registrations are for: the first reader's current one
        self.registered_bytes = 0

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
        finally:
            os.close(fd)
        self.watch(os.path.dirname(path))
        return seg

    def watch(self, directory: str) -> None:
        """With ``pin``: map (and so register) every segment file of ``directory`` now and as it appears, on a thread
        of its own, every ``WATCH_S`` seconds until ``close``. Once per directory; without ``pin``, nothing."""
        if not self.pin:
            return
        if self.device is None:
            self.device = torch.cuda.current_device()
        with self._lock:
            if directory in self._watched or self._closing.is_set():
                return
            watcher = self._watched[directory] = threading.Thread(target=self._watch, args=(directory,), daemon=True,
                                                                  name="kv-segment-watch")
        watcher.start()

    def _watch(self, directory: str) -> None:
        while not self._closing.is_set():
            try:
                names = sorted(n for n in os.listdir(directory) if n.startswith("seg-"))
            except OSError:         # not there (yet, or any more): look again later
                names = []
            for name in names:
                path = os.path.join(directory, name)
                with self._lock:
                    known = path in self._maps
                if known or self._closing.is_set():
                    continue
                try:
                    self.open(path)
                except (OSError, ValueError):     # gone meanwhile, not ours to read, or still empty: a read says so
                    pass
            self._closing.wait(WATCH_S)

    def _register(self, seg: Segment) -> bool:
        torch.cuda.set_device(self.device)        # this thread's registrations are for the reader's GPU
        cudart = torch.cuda.cudart()
        for flags in (_READ_ONLY, 0):
            if int(cudart.cudaHostRegister(seg.array.ctypes.data, seg.size, flags)) == 0:
                self.registered_bytes += seg.size
                return True
        log.warning("could not register %s with CUDA: its chunks copy to the GPU as pageable memory", seg.path)
        return False

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a view of a mapped segment (memory the store may reuse after its grace: copy it to keep it)."""
        with self._lock:
            return any(seg.holds(t) for seg in self._maps.values())

    def close(self) -> None:
        self._closing.set()
        with self._lock:
            watchers = list(self._watched.values())
        for w in watchers:
            w.join(10)
        if self._registrar is not None:
            self._registrar.shutdown(wait=True)
        with self._lock:
            for seg in self._maps.values():
                seg.close()
            self._maps.clear()
