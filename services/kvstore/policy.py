"""Eviction policies and the byte budget of one tier.

A policy only orders keys; ``Residency`` owns the sizes and the budget and asks the policy for
victims until an admission fits, so a tier's resident bytes never exceed its budget. Keys are the store's
chunk ids; any hashable key works, and the cache simulator (loadgen/sim/caches.py) runs these same classes
over its own keys: this module imports nothing but the standard library.

- ``LRUPolicy``: least recently used first.
- ``S3FIFOPolicy``: S3-FIFO (Yang et al., SOSP'23), by bytes. New keys enter a small FIFO (10% of
  the budget); a key touched while in it moves to the main FIFO when it reaches the head, an
  untouched one is evicted and remembered in a ghost FIFO, and a ghost key that comes back goes
  straight to main. Main is a FIFO with reinsertion (2-bit frequency). One-hit wonders of a Zipf
  trace therefore leave quickly without pushing out the popular chunks, which LRU does not ensure.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Protocol


class Policy(Protocol):
    def admit(self, key: Hashable, size: int) -> None: ...
    def touch(self, key: Hashable) -> None: ...
    def remove(self, key: Hashable) -> None: ...
    def evict_one(self) -> Hashable: ...


class LRUPolicy:
    def __init__(self, budget: int) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def admit(self, key: Hashable, size: int) -> None:
        self._order[key] = None

    def touch(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def evict_one(self) -> Hashable:
        return self._order.popitem(last=False)[0]


class S3FIFOPolicy:
    SMALL_FRACTION = 0.1
    MAX_FREQ = 3

    def __init__(self, budget: int) -> None:
        self._small_target = max(1, int(budget * self.SMALL_FRACTION))
        self._ghost_budget = budget      # ghost remembers about as many bytes as main holds
        self._small: OrderedDict[Hashable, int] = OrderedDict()   # key -> size, head = oldest
        self._main: OrderedDict[Hashable, int] = OrderedDict()
        self._ghost: OrderedDict[Hashable, int] = OrderedDict()
        self._freq: dict[Hashable, int] = {}
        self._small_bytes = 0
        self._ghost_bytes = 0

    def admit(self, key: Hashable, size: int) -> None:
        self.remove(key)
        self._freq[key] = 0
        ghost_size = self._ghost.pop(key, None)
        if ghost_size is not None:
            self._ghost_bytes -= ghost_size
            self._main[key] = size
        else:
            self._small[key] = size
            self._small_bytes += size

    def touch(self, key: Hashable) -> None:
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, self.MAX_FREQ)

    def remove(self, key: Hashable) -> None:
        if key in self._small:
            self._small_bytes -= self._small.pop(key)
        self._main.pop(key, None)
        self._freq.pop(key, None)

    def evict_one(self) -> Hashable:
        while True:
            if self._small and (self._small_bytes >= self._small_target or not self._main):
                key, size = self._small.popitem(last=False)
                self._small_bytes -= size
                if self._freq[key] > 0:
                    self._freq[key] = 0
                    self._main[key] = size
                    continue
                self._remember_ghost(key, size)
                del self._freq[key]
                return key
            if not self._main:
                raise KeyError("evict_one from an empty policy")
            key, size = self._main.popitem(last=False)
            if self._freq[key] > 0:
                self._freq[key] -= 1
                self._main[key] = size
                continue
            del self._freq[key]
            return key

    def _remember_ghost(self, key: Hashable, size: int) -> None:
        self._ghost[key] = size
        self._ghost_bytes += size
        while self._ghost_bytes > self._ghost_budget and self._ghost:
            self._ghost_bytes -= self._ghost.popitem(last=False)[1]


def make_policy(name: str, budget: int) -> Policy:
    return {"lru": LRUPolicy, "s3fifo": S3FIFOPolicy}[name](budget)


class Residency:
    """Which chunks one tier holds, their sizes, and the budget they must stay under."""

    def __init__(self, budget: int | None, policy: str) -> None:
        self.budget = budget            # None: unbounded (object storage)
        self.sizes: dict[Hashable, int] = {}
        self.used = 0
        self._policy = make_policy(policy, budget or 1)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.sizes

    def fits(self, size: int) -> bool:
        return self.budget is None or size <= self.budget

    def victims_for(self, key: Hashable, size: int) -> list[Hashable]:
        """Pick (and forget) the keys to drop so that ``key`` of ``size`` bytes fits; ``key`` itself
        is forgotten first when present (a replacement). The caller deletes the victims' data."""
        if not self.fits(size):
            raise ValueError(f"{size} bytes exceed the whole budget of {self.budget}")
        self.discard(key)
        victims = []
        while self.budget is not None and self.used + size > self.budget:
            victim = self._policy.evict_one()
            self.used -= self.sizes.pop(victim)
            victims.append(victim)
        return victims

    def add(self, key: Hashable, size: int) -> None:
        assert key not in self.sizes and (self.budget is None or self.used + size <= self.budget)
        self.sizes[key] = size
        self.used += size
        self._policy.admit(key, size)

    def touch(self, key: Hashable) -> None:
        self._policy.touch(key)

    def discard(self, key: Hashable) -> bool:
        size = self.sizes.pop(key, None)
        if size is None:
            return False
        self.used -= size
        self._policy.remove(key)
        return True
