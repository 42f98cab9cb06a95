"""Byte-budgeted caches for the simulator: LRU, LFU and S3-FIFO over variable-size entries.

All three share one small interface: ``lookup(key)`` says whether ``key`` is resident and
counts the access; ``insert(key, size)`` admits a key that is not resident, evicting until
it fits (an entry larger than the whole budget is not admitted). Counters: ``used`` bytes,
``evictions`` and ``evicted_bytes``.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from typing import Hashable


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


class LRUCache(_Base):
    """Least recently used first."""

    def __init__(self, capacity: float) -> None:
        super().__init__(capacity)
        self._entries: OrderedDict[Hashable, int] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def lookup(self, key: Hashable) -> bool:
        if key in self._entries:
            self._entries.move_to_end(key)
            return True
        return False

    def insert(self, key: Hashable, size: int) -> bool:
        if not self._admit(size):
            return False
        while self.used + size > self.capacity:
            _, old = self._entries.popitem(last=False)
            self._account_evict(old)
        self._entries[key] = size
        self.used += size
        self.peak = max(self.peak, self.used)
        return True


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


class S3FIFOCache(_Base):
    """S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO (10% of the bytes), a main
    FIFO with lazy promotion (2-bit access counts) and a ghost FIFO of recently evicted keys;
    a key found in the ghost goes straight to main."""

    SMALL_FRACTION = 0.1
    MAX_FREQ = 3

    def __init__(self, capacity: float) -> None:
        super().__init__(capacity)
        self._small: OrderedDict[Hashable, int] = OrderedDict()
        self._main: OrderedDict[Hashable, int] = OrderedDict()
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()
        self._freq: dict[Hashable, int] = {}
        self._small_bytes = 0
        self._small_cap = capacity * self.SMALL_FRACTION

    def __contains__(self, key: Hashable) -> bool:
        return key in self._freq

    def lookup(self, key: Hashable) -> bool:
        freq = self._freq.get(key)
        if freq is None:
            return False
        self._freq[key] = min(freq + 1, self.MAX_FREQ)
        return True

    def insert(self, key: Hashable, size: int) -> bool:
        if not self._admit(size):
            return False
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = size
        else:
            self._small[key] = size
            self._small_bytes += size
        self.used += size
        while self.used > self.capacity:
            if self._small and (self._small_bytes > self._small_cap or not self._main):
                self._evict_small()
            else:
                self._evict_main()
        self.peak = max(self.peak, self.used)
        return True

    def _evict_small(self) -> None:
        key, size = self._small.popitem(last=False)
        self._small_bytes -= size
        if self._freq[key] >= 1:          # touched while on probation: keep it
            self._freq[key] = 0
            self._main[key] = size
            return
        del self._freq[key]
        self._account_evict(size)
        self._ghost[key] = None
        while len(self._ghost) > max(len(self._main), 1):  # as many keys as main holds
            self._ghost.popitem(last=False)

    def _evict_main(self) -> None:
        key, size = self._main.popitem(last=False)
        if self._freq[key] > 0:           # lazy promotion: reinsert with one fewer credit
            self._freq[key] -= 1
            self._main[key] = size
            return
        del self._freq[key]
        self._account_evict(size)


EVICTIONS = {"lru": LRUCache, "lfu": LFUCache, "s3fifo": S3FIFOCache}


def make_cache(eviction: str, capacity: float) -> _Base:
    try:
        cls = EVICTIONS[eviction]
    except KeyError:
        raise ValueError(f"unknown eviction {eviction!r}; use one of {', '.join(EVICTIONS)}") from None
    return cls(math.inf if capacity is None else capacity)
