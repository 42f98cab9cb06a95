"""An in-process stand-in for the cluster: a two-tier chunk cache and made-up, controlled delays.

It lets replay, its metrics, reports and plots be exercised without a model or a cluster
(tests, ``tessera replay --target fake``). Its latencies are *not* measurements of anything:
TTFT = base + per-token cost of each chunk by where it came from (GPU, DRAM or computed) +
suffix compute; then one token every ``tpot_ms``. The caches are LRU over tokens and keyed as
in the simulator for the request's mode: ``full`` caches nothing, ``prefix`` reuses leading
runs, ``position_aware`` a replica per position, ``blend_copy`` and ``tessera`` one copy per
chunk (``blend_copy`` paying a copy per reused token). A DRAM hit is promoted to the GPU tier; a
computed chunk is stored in both. A request is served as the cluster serves it (and as the
simulator counts it, ``served_chunks``): one of chunks only has its last chunk's last token
computed privately, never a hit; an empty request is refused.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields
from typing import Iterator

from loadgen.replay.target import MODES, Clock, ReplayRequest, RequestStats, StreamEvent, Tier, WallClock
from loadgen.sim.caches import LRUCache
from loadgen.sim.policies import cache_keys
from loadgen.trace.model import Chunk, served_chunks

_POLICY = {"prefix": "prefix", "position_aware": "position_aware", "blend_copy": "tessera",
           "tessera": "tessera"}


@dataclass(frozen=True, slots=True)
class FakeTargetConfig:
    """Delays (ms or µs per token) and tier sizes (tokens) of the fake target."""

    base_ms: float = 1.0
    compute_us_per_token: float = 20.0
    dram_us_per_token: float = 4.0
    gpu_us_per_token: float = 0.5
    copy_us_per_token: float = 1.0   # blend_copy re-rotates each reused chunk by copying it
    tpot_ms: float = 0.5
    gpu_tokens: int = 8192
    dram_tokens: int = 65536
    fail_every: int = 0            # > 0: every n-th request fails after its first token

    def __post_init__(self) -> None:
        if any(getattr(self, f.name) < 0 for f in fields(self)):
            raise ValueError("fake target settings must be >= 0")

    @classmethod
    def parse(cls, spec: str) -> "FakeTargetConfig":
        """``fake`` or ``fake:key=value,...`` with the field names above."""
        _, _, opts = spec.partition(":")
        kwargs: dict[str, float] = {}
        names = {f.name: f.type for f in fields(cls)}
        for item in filter(None, (o.strip() for o in opts.split(","))):
            key, _, value = item.partition("=")
            if key not in names:
                raise ValueError(f"unknown fake target setting {key!r}; use {', '.join(names)}")
            try:
                kwargs[key] = int(value) if names[key] == "int" else float(value)
            except ValueError:
                raise ValueError(f"fake target setting {key}={value!r} is not a number") from None
        return cls(**kwargs)


class FakeTarget:
    """A thread-safe fake cluster (see the module docstring); ``clock`` lets tests run in virtual time."""

    def __init__(self, config: FakeTargetConfig | None = None, clock: Clock | None = None) -> None:
        self.config = config or FakeTargetConfig()
        self.clock = clock or WallClock()
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._gpu = LRUCache(self.config.gpu_tokens)
            self._dram = LRUCache(self.config.dram_tokens)
            self._chains: dict[str, dict] = {}

    def _lookup(self, request: ReplayRequest) -> dict[str, int]:
        """Tokens of this request's chunks by tier; updates the caches."""
        tiers = {Tier.GPU: 0, Tier.DRAM: 0, Tier.COMPUTED: 0}
        policy = _POLICY.get(request.mode)
        if policy is None:                       # full: no reuse at all
            tiers[Tier.COMPUTED] = sum(request.chunk_lengths)
            return tiers
        cached, private = served_chunks(
            [Chunk(d, n) for d, n in zip(request.doc_ids, request.chunk_lengths)], len(request.suffix))
        tiers[Tier.COMPUTED] += private
        with self._lock:
            keys = cache_keys(cached, policy, self._chains.setdefault(request.mode, {}))
            broken = False
            for key, n in zip(keys, (c.tokens for c in cached)):
                key = (request.mode, key)
                if not broken and self._gpu.lookup(key):
                    tiers[Tier.GPU] += n
                elif not broken and self._dram.lookup(key):
                    tiers[Tier.DRAM] += n
                    self._gpu.insert(key, n)
                else:
                    tiers[Tier.COMPUTED] += n
                    broken = policy == "prefix"
                    for tier in (self._gpu, self._dram):
                        if not tier.lookup(key):
                            tier.insert(key, n)
        return tiers

    def generate(self, request: ReplayRequest) -> Iterator[StreamEvent]:
        if request.mode not in MODES:
            raise ValueError(f"unknown mode {request.mode!r}")
        if not request.chunks and not request.suffix:    # as the cluster refuses it
            raise ValueError("empty request: no chunk and no suffix")
        c = self.config
        tiers = self._lookup(request)
        prefill_us = (c.compute_us_per_token * (tiers[Tier.COMPUTED] + len(request.suffix))
                      + c.dram_us_per_token * tiers[Tier.DRAM] + c.gpu_us_per_token * tiers[Tier.GPU])
        if request.mode == "blend_copy":
            prefill_us += c.copy_us_per_token * (tiers[Tier.DRAM] + tiers[Tier.GPU])
        self.clock.sleep(c.base_ms / 1e3 + prefill_us / 1e6)
        stats = RequestStats(tier_tokens=tiers)
        for i in range(request.max_tokens):
            if i:
                self.clock.sleep(c.tpot_ms / 1e3)
            if c.fail_every and i == 1 and (request.index + 1) % c.fail_every == 0:
                raise RuntimeError(f"fake target: request {request.request_id} failed mid-stream")
            token = (request.index * 7919 + i) % 32000
            yield StreamEvent((token,), stats if i == request.max_tokens - 1 else None)


class VirtualClock:
    """Time that passes only when slept: with one request in flight, latencies come out exact."""

    def __init__(self) -> None:
        self._t = 0.0
        self._lock = threading.Lock()

    def now(self) -> float:
        return self._t

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self._t += max(seconds, 0.0)
