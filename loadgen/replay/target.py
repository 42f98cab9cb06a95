"""What replay hands a target and what a target streams back: the interface the SDK adapter fills.

A target is any object with ``generate(request) -> Iterable[StreamEvent]`` (a blocking
iterator; replay runs each request on its own thread). Replay timestamps every event as it
arrives: the first event carrying tokens gives TTFT, later ones the inter-token latencies.
An optional ``reset()`` is called before each mode of a ``--compare`` run so that the modes
start from the same (cold) cache state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Protocol, runtime_checkable

from services.modes import MODES  # noqa: F401 - named here for loadgen's modules (one definition)
from services.tiers import TIER_ORDER, Tier  # noqa: F401 - likewise: where a chunk's KV came from, best first


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """One trace request, made concrete.

    chunks: token ids of each chunk in prompt order (chunks[i] has len chunk_lengths[i]).
    doc_ids: the trace's document id of each chunk (targets may name chunks by it).
    suffix: the private suffix's token ids.
    max_tokens: tokens to generate (the trace's output_length); the target ignores EOS.
    """

    request_id: str
    index: int
    mode: str
    doc_ids: tuple[int, ...]
    chunks: tuple[tuple[int, ...], ...]
    suffix: tuple[int, ...]
    max_tokens: int

    @property
    def chunk_lengths(self) -> tuple[int, ...]:
        return tuple(len(c) for c in self.chunks)

    @property
    def input_tokens(self) -> int:
        return sum(self.chunk_lengths) + len(self.suffix)


@dataclass(frozen=True, slots=True)
class RequestStats:
    """Per-request cache outcome, sent once (on the last event).

    tier_tokens: chunk tokens served from each tier (``Tier`` values; "computed" = missed),
    summing to the request's chunk tokens.
    """

    tier_tokens: Mapping[str, int] = field(default_factory=dict)
    recomputed_tokens: int = 0     # chunk tokens recomputed by the blend step (hits, yet computed)
    stage_s: Mapping[str, float] = field(default_factory=dict)  # seconds per serving stage, when the target knows them


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One streamed message: the tokens it carries (usually one) and, on the last, the stats."""

    token_ids: tuple[int, ...] = ()
    stats: RequestStats | None = None


@runtime_checkable
class ReplayTarget(Protocol):
    def generate(self, request: ReplayRequest) -> Iterable[StreamEvent]: ...


class Clock(Protocol):
    def now(self) -> float: ...
    def sleep(self, seconds: float) -> None: ...


class WallClock:
    """Real time: perf_counter and sleep."""

    def now(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)
