"""A worker's own chunk tier in host memory, in front of the KV store shards.

The store shards are the cluster's shared tiers, reached through gRPC: a 64 MiB chunk (512 tokens of
a Llama-3-8B) streams in tens of milliseconds, longer than the GPU takes to compute it. Chunks this
worker has already had in hand (computed and written to the store, or streamed from it) are kept
here as well, in pinned memory when the engine is on a GPU, so that after the GPU cache evicts them
they come back at host-to-device copy speed: LMCache's local CPU tier, vLLM's CPU offloading.

Entries are filled only from copies the worker makes anyway (the device-to-host copy of a store
write, the layers of a store read), least recently used first out within a byte budget. An entry
is immutable once put: readers keep the tensors they were given, so eviction meanwhile frees nothing
under them. An entry filled by an asynchronous device-to-host copy carries the copy's event and its
layers are handed out only after the event.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from services.engine.kv.loader import StreamedLayer


@dataclass(frozen=True, slots=True)
class HostEntry:
    """One chunk: ``layers[i]`` = (k, v) of layer i, each [L, Hkv, D] on the CPU; ``ready``: a
    torch.cuda.Event marking the copies that fill them done, or None."""

    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    nbytes: int
    ready: torch.cuda.Event | None = None

    def stream(self) -> "HostStream":
        """(layer, k, v) triples, as a store read yields them."""
        return HostStream(self)


class HostStream:
    """An entry's layers as an iterator marked ``local``: the engine then knows they land within
    milliseconds (services/engine/kv/loader.py) and waits for all of them before replaying its graphs."""

    local = True

    def __init__(self, entry: HostEntry) -> None:
        self._entry, self._next = entry, 0

    def __iter__(self) -> "HostStream":
        return self

    def __next__(self) -> StreamedLayer:
        if self._next == 0 and self._entry.ready is not None:
            self._entry.ready.synchronize()
        if self._next >= len(self._entry.layers):
            raise StopIteration
        i = self._next
        self._next += 1
        k, v = self._entry.layers[i]
        return StreamedLayer(i, k, v)


def layers_nbytes(layers) -> int:
    return sum(t.numel() * t.element_size() for kv in layers for t in kv)


class HostChunks:
    """Chunk id -> HostEntry, least recently used evicted past ``budget_bytes``. Thread-safe: the engine
    thread looks up, store-write and hand-off helper threads put."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"host cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget = budget_bytes
        self.used = 0
        self.hits = self.misses = self.evictions = 0
        self._entries: OrderedDict[str, HostEntry] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, chunk_id: str) -> bool:
        with self._lock:
            return chunk_id in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def get(self, chunk_id: str) -> HostEntry | None:
        with self._lock:
            entry = self._entries.get(chunk_id)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(chunk_id)
            self.hits += 1
            return entry

    def put(self, chunk_id: str, layers, ready=None) -> bool:
        """Keep ``layers`` [(k, v), ...] (CPU tensors, not copied: the caller hands them over) under
        ``chunk_id``; False when one chunk exceeds the whole budget. A second put of an id keeps the
        first (the same content: ids are content hashes)."""
        entry = HostEntry(tuple((k, v) for k, v in layers), layers_nbytes(layers), ready)
        if any(t.is_cuda for kv in entry.layers for t in kv):
            raise ValueError(f"host cache entries must be CPU tensors (chunk {chunk_id[:12]})")
        with self._lock:
            if chunk_id in self._entries:
                self._entries.move_to_end(chunk_id)
                return True
            if entry.nbytes > self.budget:
                return False
            while self.used + entry.nbytes > self.budget:
                _, old = self._entries.popitem(last=False)
                self.used -= old.nbytes
                self.evictions += 1
            self._entries[chunk_id] = entry
            self.used += entry.nbytes
            return True

    def drop(self, chunk_ids) -> int:
        """Forget these chunks; returns how many were held."""
        with self._lock:
            gone = [self._entries.pop(cid) for cid in set(chunk_ids) if cid in self._entries]
            self.used -= sum(e.nbytes for e in gone)
            return len(gone)

    def clear(self) -> int:
        with self._lock:
            n = len(self._entries)
            self._entries.clear()
            self.used = 0
            return n
