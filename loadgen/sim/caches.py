"""Byte-budgeted caches for the simulator over variable-size entries: LRU and S3-FIFO are the store's own.

LRU and S3-FIFO run the KV store's eviction (``services.kvstore.policy``: its ``Residency`` and policies, as
one store tier runs them), so the simulator's figures are the store's, not a rewrite's; LFU, which the store
does not have, is the simulator's own. All share one small interface: ``lookup(key)`` says whether ``key`` is
resident and counts the access; ``insert(key, size)`` admits a key that is not resident, evicting until it
fits (an entry larger than the whole budget is not admitted). Counters: ``used`` bytes, ``peak``,
``evictions``, ``evicted_bytes`` and ``rejected``.
"""

from __future__ import annotations

import heapq
import math
from typing import Hashable

from services.kvstore.policy import Residency


class _Base:
    def __init__(self, capacity: float) -> None:
        if not capacity >= 0:
            raise ValueError(f"cache capacity must be >= 0 bytes, got {capacity}")
        self.capacity = capacity
        self.used = 0
        self.peak = 0
        self.evictions = 0
        self.evicted_bytes = 0
        self.rejected = 0  # entries larger than the whole budget

    def _admit(self, size: int) -> bool:
        if size > self.capacity:
            self.rejected += 1
            return False
        return True

    def _account_evict(self, size: int) -> None:
        self.used -= size
        self.evictions += 1
        self.evicted_bytes += size


class _StoreCache(_Base):
    """One store tier's bookkeeping (``Residency``) under the store's policy named ``POLICY``."""

    POLICY: str

    def __init__(self, capacity: float) -> None:
        super().__init__(capacity)
        self._tier = Residency(None if math.isinf(capacity) else capacity, self.POLICY)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._tier

    def lookup(self, key: Hashable) -> bool:
        if key in self._tier:
            self._tier.touch(key)
            return True
        return False

    def insert(self, key: Hashable, size: int) -> bool:
        if not self._admit(size):
            return False
        before = self._tier.used
        victims = self._tier.victims_for(key, size)
        if victims:
            self.evictions += len(victims)
            self.evicted_bytes += before - self._tier.used
        self._tier.add(key, size)
        self.used = self._tier.used
        self.peak = max(self.peak, self.used)
        return True


class LRUCache(_StoreCache):
    """The store's LRU: least recently used first."""

    POLICY = "lru"


class LFUCache(_Base):
    """Least frequently used first, least recently used among equals (a lazy heap)."""

    def __init__(self, capacity: float) -> None:
        super().__init__(capacity)
        self._entries: dict[Hashable, tuple[int, int, int]] = {}  # key -> (freq, tick, size)
        self._heap: list[tuple[int, int, Hashable]] = []          # stale items skipped on pop
        self._tick = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def _push(self, key: Hashable, freq: int, size: int) -> None:
        self._tick += 1
        self._entries[key] = (freq, self._tick, size)
        heapq.heappush(self._heap, (freq, self._tick, key))
        if len(self._heap) > 4 * len(self._entries) + 64:  # drop stale items now and then
            self._heap = [(f, t, k) for k, (f, t, _) in self._entries.items()]
            heapq.heapify(self._heap)

    def lookup(self, key: Hashable) -> bool:
        found = self._entries.get(key)
        if found is None:
            return False
        self._push(key, found[0] + 1, found[2])
        return True

    def insert(self, key: Hashable, size: int) -> bool:
        if not self._admit(size):
            return False
        while self.used + size > self.capacity:
            freq, tick, old = heapq.heappop(self._heap)
            live = self._entries.get(old)
            if live is not None and live[0] == freq and live[1] == tick:
                del self._entries[old]
                self._account_evict(live[2])
        self._push(key, 1, size)
        self.used += size
        self.peak = max(self.peak, self.used)
        return True


class S3FIFOCache(_StoreCache):
    """The store's S3-FIFO (Yang et al., SOSP'23; services/kvstore/policy.py says how it runs)."""

    POLICY = "s3fifo"


EVICTIONS = {"lru": LRUCache, "lfu": LFUCache, "s3fifo": S3FIFOCache}


def make_cache(eviction: str, capacity: float) -> _Base:
    try:
        cls = EVICTIONS[eviction]
    except KeyError:
        raise ValueError(f"unknown eviction {eviction!r}; use one of {', '.join(EVICTIONS)}") from None
    return cls(math.inf if capacity is None else capacity)
