"""Drive a target with a trace: open loop (trace timestamps or a re-timed rate) or closed loop.

Open loop: a dispatcher sends each request at its arrival time on its own worker thread
(at most ``max_in_flight`` at once; beyond that requests wait for a free worker, and that
wait is not hidden: their latencies are measured from when they are sent). Closed loop
(``concurrency``): C workers each send the next request as soon as their last one ends.
``duration_s`` stops sending new requests after that many seconds; requests in flight end.
``offset`` / ``limit`` replay a window of the trace; a request keeps its index in the trace
(its id, its suffix's token ids and its record say where it came from).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Sequence

import numpy as np

from loadgen.replay.target import MODES, Clock, ReplayRequest, ReplayTarget, WallClock
from loadgen.trace.model import TraceRequest
from loadgen.trace.synth import arrival_times_ms
from loadgen.trace.tokens import doc_token_ids, suffix_token_ids


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """How to replay: schedule, mode and how document ids become token ids."""

    mode: str = "tessera"
    rate: float | None = None          # re-time arrivals: Poisson/gamma at this many req/s
    burstiness: float = 1.0            # gamma shape for ``rate`` (1: Poisson)
    concurrency: int | None = None     # closed loop with this many requests in flight
    duration_s: float | None = None
    max_in_flight: int = 256           # open loop worker threads
    vocab_size: int = 32000
    token_low: int = 0                 # keep ids below this (special tokens) out of prompts
    token_seed: int = 0
    arrival_seed: int = 0
    offset: int = 0                    # replay requests offset .. offset + limit - 1 of the trace
    limit: int | None = None           # None: to the end of the trace

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; use one of {', '.join(MODES)}")
        if self.rate is not None and self.concurrency is not None:
            raise ValueError("give --rate or --concurrency, not both")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration must be > 0 s, got {self.duration_s}")
        if self.max_in_flight < 1 or not 0 <= self.token_low < self.vocab_size:
            raise ValueError("need max_in_flight >= 1 and 0 <= token_low < vocab_size")
        if self.offset < 0 or (self.limit is not None and self.limit < 1):
            raise ValueError(f"need offset >= 0 and limit >= 1, got offset {self.offset}, limit {self.limit}")


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What happened to one request; times in seconds from the start of the run.

    ttft_s/e2el_s are None and ``error`` is set when it failed. itl_s: gaps between
    successive token-carrying events. tier_tokens: from the target's stats ({} if none).
    """

    index: int
    request_id: str
    mode: str
    scheduled_s: float
    sent_s: float
    ttft_s: float | None
    e2el_s: float | None
    itl_s: tuple[float, ...]
    input_tokens: int
    chunk_tokens: int
    output_tokens: int
    tier_tokens: dict[str, int] = field(default_factory=dict)
    recomputed_tokens: int = 0
    error: str | None = None
    stage_s: dict[str, float] = field(default_factory=dict)   # seconds per serving stage (target's stats)

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True, slots=True)
class ReplayRun:
    """One mode's replay: its records (in trace order) and the wall time it took."""

    mode: str
    records: tuple[RequestRecord, ...]
    duration_s: float


class _Tokens:
    """Token ids of trace requests, documents memoised (the same doc has the same ids)."""

    def __init__(self, cfg: ReplayConfig) -> None:
        self.cfg = cfg
        self.doc = lru_cache(maxsize=8192)(self._doc)

    def _doc(self, doc: int, n: int) -> tuple[int, ...]:
        c = self.cfg
        return tuple(doc_token_ids(doc, n, c.vocab_size, seed=c.token_seed, low=c.token_low).tolist())

    def request(self, req: TraceRequest, index: int, mode: str) -> ReplayRequest:
        c = self.cfg
        suffix = suffix_token_ids(index, req.suffix_tokens, c.vocab_size, seed=c.token_seed, low=c.token_low)
        return ReplayRequest(
            request_id=f"{mode}-{index}", index=index, mode=mode,
            doc_ids=tuple(ch.doc for ch in req.chunks),
            chunks=tuple(self.doc(ch.doc, ch.tokens) for ch in req.chunks),
            suffix=tuple(suffix.tolist()), max_tokens=req.output_length)


def _send(target: ReplayTarget, req: ReplayRequest, scheduled: float, clock: Clock,
          t0: float) -> RequestRecord:
    sent = clock.now()
    first = last = None
    gaps: list[float] = []
    n_out, stats, error = 0, None, None
    try:
        for event in target.generate(req):
            now = clock.now()
            if event.token_ids:
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
                n_out += len(event.token_ids)
            if event.stats is not None:
                stats = event.stats
        if first is None:
            error = "the stream ended without a token"
    except Exception as exc:  # noqa: BLE001 - any failure of a request is recorded, not raised
        error = f"{type(exc).__name__}: {exc}"
    end = clock.now()
    return RequestRecord(
        index=req.index, request_id=req.request_id, mode=req.mode, scheduled_s=scheduled,
        sent_s=sent - t0, ttft_s=None if error else first - sent, e2el_s=None if error else end - sent,
        itl_s=tuple(gaps), input_tokens=req.input_tokens, chunk_tokens=sum(req.chunk_lengths),
        output_tokens=n_out, tier_tokens=dict(stats.tier_tokens) if stats else {},
        recomputed_tokens=stats.recomputed_tokens if stats else 0,
        stage_s=dict(stats.stage_s) if stats else {}, error=error)


def selected(trace: Sequence[TraceRequest], cfg: ReplayConfig) -> range:
    """The trace indices ``cfg`` replays: ``offset`` to ``offset + limit - 1``, or to the end."""
    if cfg.offset >= len(trace):
        raise ValueError(f"offset {cfg.offset} is past the end of the trace ({len(trace)} requests)")
    stop = len(trace) if cfg.limit is None else min(len(trace), cfg.offset + cfg.limit)
    return range(cfg.offset, stop)


def arrival_schedule(trace: Sequence[TraceRequest], cfg: ReplayConfig) -> np.ndarray:
    """Send times in seconds from the start: the trace's own, or re-timed at ``cfg.rate``."""
    if cfg.rate is not None:
        rng = np.random.default_rng(cfg.arrival_seed)
        return arrival_times_ms(rng, len(trace), cfg.rate, cfg.burstiness) / 1000.0
    ts = np.array([r.timestamp_ms for r in trace], dtype=np.float64)
    return (ts - ts[0]) / 1000.0


def replay(trace: Sequence[TraceRequest], target: ReplayTarget, cfg: ReplayConfig,
           clock: Clock | None = None, on_done: Callable[[RequestRecord], None] | None = None) -> ReplayRun:
    """Replay ``trace`` (the window ``selected``) against ``target`` in ``cfg.mode``; ``on_done``
    is called per request."""
    clock = clock or WallClock()
    tokens = _Tokens(cfg)
    picked = selected(trace, cfg)
    sched = arrival_schedule([trace[i] for i in picked], cfg)
    records: list[RequestRecord] = []
    lock = threading.Lock()
    t0 = clock.now()

    def finish(rec: RequestRecord) -> None:
        with lock:
            records.append(rec)
        if on_done is not None:
            on_done(rec)

    def past_duration() -> bool:
        return cfg.duration_s is not None and clock.now() - t0 >= cfg.duration_s

    if cfg.concurrency is not None:
        cursor = iter(picked)

        def worker() -> None:
            while not past_duration():
                with lock:
                    i = next(cursor, None)
                if i is None:
                    return
                req = tokens.request(trace[i], i, cfg.mode)
                finish(_send(target, req, clock.now() - t0, clock, t0))

        with ThreadPoolExecutor(cfg.concurrency, thread_name_prefix="replay") as pool:
            for f in [pool.submit(worker) for _ in range(cfg.concurrency)]:
                f.result()
    else:
        with ThreadPoolExecutor(cfg.max_in_flight, thread_name_prefix="replay") as pool:
            futures = []
            for i, at in zip(picked, sched.tolist()):
                if cfg.duration_s is not None and at >= cfg.duration_s:
                    break
                clock.sleep(t0 + at - clock.now())
                # Token ids are made on the worker so that the dispatcher keeps to the schedule.
                futures.append(pool.submit(lambda i=i, at=at: finish(_send(
                    target, tokens.request(trace[i], i, cfg.mode), at, clock, t0))))
            for f in futures:
                f.result()
    records.sort(key=lambda r: r.index)
    return ReplayRun(cfg.mode, tuple(records), clock.now() - t0)
