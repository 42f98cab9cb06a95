"""CacheBlend's loading controller (§5): pick the recompute ratio that hides behind the load.

Recomputing a fraction r of the chunk tokens costs about r * T * c seconds (T chunk tokens, c the
measured seconds per computed token); loading the store-held chunks costs about B * l seconds (B
bytes, l the measured seconds per loaded byte). When loading dominates, recomputing more is free:
ratio = clamp(B * l / (T * c), floor, 1). The floor (default 0.15) is the quality guarantee.
Measurements are exponential moving averages of what the engine reported on earlier requests.

The same two measurements decide whether a store-held chunk is worth loading at all (``prefer_load``):
when streaming its bytes takes longer than computing its tokens (a small model on a fast GPU, a
slow store), the chunk is computed instead, except for one request in ``probe_every`` that still
loads, so that the load estimate follows the store (``probe_every=1``: every request loads). With ``loads`` off
no chunk is loaded at all: every chunk the GPU lacks is computed (the store path off, for an A/B).

Recomputing is free only while the GPU would otherwise wait for the load. With requests queued behind this one
(``ratio(..., waiting=n)``, n > 0: the worker's engine loop has submissions waiting), every token recomputed past the
floor delays them, so the floor is used. Measured on four H200s (bench/cluster/README.md, "the loading controller's
backlog rule"): with this rule the mean ratio was the floor (0.150) and a prefill took 89.7 ms; the tree before it, in
the same call, took 89.7 ms too. There the store's DRAM tier loads fast enough that, by those times, the load never
asked for more: the rule changes nothing where loads are hidden; it is meant for a slower store (the gRPC stream,
another host), where queued requests would pay for recomputation (not measured there).

NOTE: the ratio is rounded up to a multiple of ``step`` (default 0.05). A continuous ratio gives
nearly every request its own number of recomputed tokens, hence its own static-tail shape, and the
engine would capture a new CUDA graph for most requests; rounding up only recomputes a little more.
"""

from __future__ import annotations

import math
import threading


class LoadingController:
    def __init__(self, floor: float = 0.15, smoothing: float = 0.2, step: float = 0.05, probe_every: int = 8,
                 loads: bool = True) -> None:
        if not 0.0 <= floor <= 1.0:
            raise ValueError(f"floor must be in [0, 1], got {floor}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        if not 0.0 < step <= 1.0:
            raise ValueError(f"step must be in (0, 1], got {step}")
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {probe_every}")
        self.step = step
        self.probe_every = probe_every
        self.loads = loads
        self._decisions = 0
        self.floor = floor
        self.smoothing = smoothing
        self.seconds_per_token: float | None = None   # computing one chunk token alone
        self.seconds_per_byte: float | None = None    # streaming one byte of chunk KV from the store
        self._lock = threading.Lock()

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def observe(self, stats, loads: bool = True) -> None:
        """Learn from a PrefillStats: chunk compute time per token, and (unless ``loads`` is False) store
        load time per byte."""
        with self._lock:
            if stats.chunk_tokens_computed > 0 and stats.chunk_compute_seconds > 0:
                self.seconds_per_token = self._ewma(self.seconds_per_token,
                                                    stats.chunk_compute_seconds / stats.chunk_tokens_computed)
            loaded = stats.loaded_bytes
            if loads and loaded > 0 and stats.load_seconds > 0:
                self.seconds_per_byte = self._ewma(self.seconds_per_byte, stats.load_seconds / loaded)

    def prefer_load(self, nbytes: int, tokens: int) -> bool:
        """Whether to stream a chunk of ``nbytes`` (``tokens`` tokens) from the store rather than compute
        it: yes until both costs are measured, when loading is the faster, and on probe requests."""
        with self._lock:
            self._decisions += 1
            if self.seconds_per_token is None or self.seconds_per_byte is None:
                return True
            if self._decisions % self.probe_every == 0:
                return True
            return nbytes * self.seconds_per_byte <= tokens * self.seconds_per_token

    def ratio(self, store_bytes: int, chunk_tokens: int, waiting: int = 0) -> float:
        """The recompute ratio for a request loading ``store_bytes`` over ``chunk_tokens`` chunk tokens; ``waiting``:
        requests queued behind it (then the floor: see the module's docstring)."""
        with self._lock:
            if (waiting > 0 or store_bytes <= 0 or chunk_tokens <= 0 or self.seconds_per_token is None
                    or self.seconds_per_byte is None):
                return self.floor
            hidden = store_bytes * self.seconds_per_byte / (chunk_tokens * self.seconds_per_token)
        stepped = math.ceil(hidden / self.step - 1e-9) * self.step
        return min(1.0, max(self.floor, round(stepped, 9)))
