"""The store's NIXL agent over its arena (issue #23): workers on other hosts read a chunk's layers straight from the
store's memory over NIXL (UCX), the gRPC ``Get`` carrying only where they lie (``NixlLayers``).

Each arena segment is mapped and registered with the agent once, as the arena makes it (``Arena.on_segment``). A read
names the layers' spans and the extent's header; the reader reads the layers, then the header, and uses them only if
the header still holds the generation the store named and each layer passes its CRC-32 (the store zeroes a freed
extent's header at once and reuses its room only after the arena's grace). Loaded only in a store started with
``--nixl`` (NIXL's native libraries must not share a process with grpc_tools': services/handoff/nixl.py)."""

from __future__ import annotations

import mmap
import os
import threading

import numpy as np
import torch

from services.kvstore.tiers import LocalFile


class ArenaExporter:
    def __init__(self) -> None:
        from services.handoff.nixl import NixlEndpoint

        self.endpoint = NixlEndpoint(name=f"tessera-store-{os.getpid()}-{os.urandom(3).hex()}")
        self._segments: dict[str, tuple[mmap.mmap, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def add(self, path: str, size: int) -> None:
        """Map and register a segment the arena just made."""
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        t = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))
        self.endpoint.register([t])
        with self._lock:
            self._segments[path] = (mm, t)

    def layers(self, place: LocalFile, nbytes: list[int]) -> dict | None:
        """The ``NixlLayers`` fields for the layers at ``place`` (an arena extent's), None when its segment is not
        registered here."""
        with self._lock:
            found = self._segments.get(place.path)
        if found is None or not place.generation:
            return None
        t = found[1]
        return {"agent": self.endpoint.name, "metadata": self.endpoint.metadata,
                "descs": self.endpoint.descs_of([t[o:o + n] for o, n in zip(place.offsets, nbytes)]),
                "header_descs": self.endpoint.descs_of([t[place.header:place.header + 16]]),
                "generation": place.generation}

    def close(self) -> None:
        self.endpoint.close()
        with self._lock:
            self._segments.clear()
