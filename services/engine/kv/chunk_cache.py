"""Chunk registry and the device-resident chunk cache.

A chunk is named by a content hash of (model fingerprint, token ids): the same id names it in
every tier and on every worker. The cache maps a key (the chunk id in ``tessera`` mode; the id plus
its position for ``position_aware``; the hash of the whole prefix for ``prefix``) to the blocks that
hold its KV. Entries are shared and read-only; a request pins the entries it uses (``refs``), and
only unpinned entries are evicted, least recently used first, to honour the byte budget.

The budget bounds what stays cached, not what requests in flight may use: when pinned entries
fill it, a new chunk is still placed if the pool has the blocks (``overflows`` counts it), and
entries over the budget are evicted as soon as their last request releases them. Only a full pool
refuses a request.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

from services.engine.kv.block_pool import BlockPool, PoolExhausted
from services.engine.kv.chunk_ids import chunk_ids_of
from services.engine.kv.request_ids import part_ids

if TYPE_CHECKING:
    import numpy as np
    import torch


def chunk_id(fingerprint: str, tokens: Iterable[int]) -> str:
    """Content id of a chunk: sha256 over the model fingerprint and the int64 token ids. Ids are read as
    request ids are (``part_ids``): a float, a string or an id past int64 is refused by name, never truncated."""
    _, ids = part_ids(tokens, "the chunk")
    if ids is None:
        raise ValueError("a token id of the chunk does not fit int64")
    return chunk_ids_of(fingerprint, ids, [ids.size])[0]




@dataclass(slots=True)
class ChunkEntry:
    """KV of one chunk: ``length`` tokens laid densely over ``blocks`` (all layers).

    ``base`` is the position its first key was rotated at (0 for position-agnostic entries).
    ``slots``: the device index of each token's slot in a layer's flat [N*BS] view, and ``ids``, its
    token ids on the device, made on first use from ``host_slots`` and ``host_ids``, the same on the host
    (Forward.chunk_slots, chunk_ids, host_chunk_slots, host_chunk_ids). An entry's blocks never change
    while it is cached, and an evicted chunk comes back as a new entry, so the memo can never name
    another chunk's slots.
    """

    key: str
    blocks: list[int]
    length: int
    base: int
    nbytes: int
    refs: int = 0
    kind: str = "chunk"   # chunk (position-agnostic, by content id) | position (a replica) | prefix (chain hash)
    bounded: bool = False  # its blocks' page bounds are computed (once while resident, by the first sparse decode)
    slots: torch.Tensor | None = field(default=None, repr=False, compare=False)  # int64 [length] once made
    ids: torch.Tensor | None = field(default=None, repr=False, compare=False)    # its token ids on the device, likewise
    host_ids: np.ndarray | None = field(default=None, repr=False, compare=False)    # int64 [length]: ids on the host
    host_slots: np.ndarray | None = field(default=None, repr=False, compare=False)  # int64 [length]: slots on the host


class ChunkCache:
    def __init__(self, pool: BlockPool, budget_bytes: int):
        if budget_bytes < pool.block_bytes:
            raise ValueError(f"chunk cache budget {budget_bytes} B is below one block ({pool.block_bytes} B)")
        self.pool = pool
        self.budget_bytes = budget_bytes
        self.resident_bytes = 0
        self.evictions = 0
        self.overflows = 0       # chunks placed past the budget because every cached entry was pinned
        self._entries: OrderedDict[str, ChunkEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def keys(self) -> list[str]:
        return list(self._entries)

    def acquire(self, key: str) -> ChunkEntry | None:
        """Pin and return a resident entry (most recently used now), or None."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            entry.refs += 1
        return entry

    def release(self, entry: ChunkEntry) -> None:
        if entry.refs <= 0:
            raise RuntimeError(f"chunk {entry.key[:12]} released more often than acquired")
        entry.refs -= 1
        while self.resident_bytes > self.budget_bytes and self._evict_one():
            pass        # back within the budget once requests let go of what overflowed it

    def allocate(self, n_blocks: int, for_cache: bool, contiguous: bool = False) -> list[int]:
        """Blocks for a new entry (``for_cache``: counted against the budget) or for private use,
        evicting unpinned entries LRU-first until they fit; past the budget only while every cached
        entry is pinned (see the module docstring). ``contiguous``: consecutive ids when a run is free."""
        need_bytes = n_blocks * self.pool.block_bytes if for_cache else 0
        while self.pool.num_free < n_blocks or self.resident_bytes + need_bytes > self.budget_bytes:
            if not self._evict_one():
                break
        if self.pool.num_free < n_blocks:
            raise PoolExhausted(
                f"KV memory exhausted: {n_blocks} blocks wanted, {self.pool.num_free} free, "
                f"{self.resident_bytes} B of chunk cache pinned by requests in flight")
        if self.resident_bytes + need_bytes > self.budget_bytes:
            self.overflows += 1
        return self.pool.allocate(n_blocks, contiguous=contiguous)

    def available_blocks(self) -> int:
        """Blocks an allocation could have now: the free ones and those of unpinned entries (evicted for it)."""
        return self.pool.num_free + sum(len(e.blocks) for e in self._entries.values() if e.refs == 0)

    def insert(self, key: str, blocks: list[int], length: int, base: int = 0, kind: str = "chunk") -> ChunkEntry:
        """Register freshly written blocks under ``key``; returned pinned (refs = 1)."""
        if key in self._entries:
            raise RuntimeError(f"chunk {key[:12]} is already resident")
        entry = ChunkEntry(key, blocks, length, base, len(blocks) * self.pool.block_bytes, refs=1, kind=kind)
        self._entries[key] = entry
        self.resident_bytes += entry.nbytes
        return entry

    def discard(self, entry: ChunkEntry) -> None:
        """Drop an entry whose KV cannot be trusted (a load that never completed), pinned or not."""
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
            self.resident_bytes -= entry.nbytes
            self.pool.free(entry.blocks)

    def _evict_one(self) -> bool:
        for key, entry in self._entries.items():  # oldest first
            if entry.refs == 0:
                del self._entries[key]
                self.resident_bytes -= entry.nbytes
                self.pool.free(entry.blocks)
                self.evictions += 1
                return True
        return False

    def clear(self) -> None:
        """Drop every unpinned entry."""
        while self._evict_one():
            pass

    def drop(self, chunk_ids) -> int:
        """Drop the unpinned entries of these chunks (and their position-aware replicas, keyed ``id@start``);
        returns how many were dropped."""
        ids = set(chunk_ids)
        gone = [k for k, e in self._entries.items() if e.refs == 0 and (k in ids or k.partition("@")[0] in ids)]
        for key in gone:
            entry = self._entries.pop(key)
            self.resident_bytes -= entry.nbytes
            self.pool.free(entry.blocks)
        return len(gone)
