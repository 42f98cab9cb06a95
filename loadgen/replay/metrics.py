"""The summary of a replay, in the names users know from ``vllm bench serve``.

TTFT: send to first token. TPOT: (E2EL - TTFT) / (output tokens - 1), per request with more
than one token (the first token excluded). ITL: every gap between successive streamed
events. E2EL: send to end of stream. Each as mean/p50/p90/p99 in ms over successful
requests. Goodput: requests per second meeting every SLO given. Hit ratios: chunk tokens
by tier over all chunk tokens, from the target's per-request stats; the hit ratio is the tokens
that a tier other than "computed" served (so a token missing from the stats is no hit).

Throughput comes twice. ``request_throughput`` (and the token ones) divide by the whole run,
start-up and drain included: a closed loop of C clients over N requests ends with a drain in
which only the last requests decode and none arrives (a large share of a short run), which
penalises most the mode whose prefill is short. The *steady* throughputs count only while the
offered load was on: the window opens at the first completion and closes at the last send
(send: ``sent_s``; completion: ``sent_s + e2el_s``; successful requests only), and

    steady_request_throughput = (completions in [first completion, last send] - 1) / window

(the first completion opens the window, so it is not counted: completions per second between
the opening one and the last send). The steady token throughputs take the tokens of the same
completions (the opening one left out) over the same window. All are None when the window is
empty or holds fewer than 2 completions.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np

from loadgen.replay.runner import ReplayRun, RequestRecord
from loadgen.replay.target import TIER_ORDER, Tier

PERCENTILES = (50, 90, 99)
_SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True, slots=True)
class Slo:
    """Service-level objectives in ms; None = not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def __post_init__(self) -> None:
        for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms):
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"SLO values must be positive milliseconds, got {v}")

    @classmethod
    def parse(cls, text: str) -> "Slo":
        """``ttft:500,tpot:50`` (also ``e2el:MS``)."""
        values: dict[str, float] = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, sep, ms = item.partition(":")
            if not sep or key not in _SLO_KEYS:
                raise ValueError(f"bad SLO {item!r}; use e.g. ttft:500,tpot:50 (keys: {', '.join(_SLO_KEYS)})")
            try:
                values[f"{key}_ms"] = float(ms)
            except ValueError:
                raise ValueError(f"bad SLO {item!r}: {ms!r} is not a number of ms") from None
        if not values:
            raise ValueError("an SLO needs at least one of ttft:MS, tpot:MS, e2el:MS")
        return cls(**values)

    def met(self, rec: RequestRecord) -> bool:
        if not rec.ok:
            return False
        tpot = tpot_s(rec)
        return ((self.ttft_ms is None or rec.ttft_s * 1e3 <= self.ttft_ms)
                and (self.tpot_ms is None or tpot is None or tpot * 1e3 <= self.tpot_ms)
                and (self.e2el_ms is None or rec.e2el_s * 1e3 <= self.e2el_ms))


def tpot_s(rec: RequestRecord) -> float | None:
    if not rec.ok or rec.output_tokens < 2:
        return None
    return (rec.e2el_s - rec.ttft_s) / (rec.output_tokens - 1)


def _stats_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    if not len(values_s):
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    x = np.asarray(values_s, dtype=np.float64) * 1e3
    return {"mean": float(x.mean()), **{f"p{p}": float(np.percentile(x, p)) for p in PERCENTILES}}


@dataclass(frozen=True, slots=True)
class Summary:
    """One mode's figures (JSON-ready via ``to_json``); latency dicts hold mean/p50/p90/p99 in ms."""

    mode: str
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float | None      # completed requests / s (None if no time passed)
    output_throughput: float | None       # output tokens / s
    total_token_throughput: float | None  # (input + output) tokens / s
    ttft_ms: dict
    tpot_ms: dict
    itl_ms: dict
    e2el_ms: dict
    goodput: float | None            # requests / s meeting the SLO
    slo: dict | None
    chunk_tokens: int
    hit_ratio: float | None          # chunk tokens not computed / chunk tokens
    tier_hit_ratios: dict            # tier -> share of chunk tokens ("computed" included)
    stage_p50_ms: dict = field(default_factory=dict)  # serving stage -> median ms, over requests reporting it
    # and the mean: what a queue in front of a stage follows (a few slow requests move it, not the median)
    stage_mean_ms: dict = field(default_factory=dict)
    # while the load was on (module docstring): window [first completion, last send]
    steady_window_s: float | None = None             # last send - first completion (None: no window)
    steady_completed: int = 0                        # completions in the window, the opening one included
    steady_request_throughput: float | None = None   # (steady_completed - 1) / steady_window_s
    steady_output_throughput: float | None = None    # output tokens of those completions / s
    steady_total_token_throughput: float | None = None   # (input + output) tokens of those completions / s

    def to_json(self) -> dict:
        return asdict(self)


def summarize(run: ReplayRun, slo: Slo | None = None) -> Summary:
    ok = [r for r in run.records if r.ok]

    def per_s(x: float) -> float | None:
        return x / run.duration_s if run.duration_s > 0 else None

    n_in = sum(r.input_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    tpots = [t for t in map(tpot_s, ok) if t is not None]
    with_stats = [r for r in ok if r.tier_tokens]
    chunk_tokens = sum(r.chunk_tokens for r in with_stats)
    tiers: dict[str, int] = {}
    for r in with_stats:
        for tier, n in r.tier_tokens.items():
            tiers[tier] = tiers.get(tier, 0) + n
    order = sorted(tiers, key=lambda t: (TIER_ORDER.index(t) if t in TIER_ORDER else len(TIER_ORDER), t))
    tier_ratios = {t: tiers[t] / chunk_tokens for t in order} if chunk_tokens else {}
    # Hits are the tokens a tier served: a chunk token the target leaves out of its stats (say, a
    # request's private last token reported as suffix) is not one.
    hit = sum(tiers[t] for t in order if t != Tier.COMPUTED) / chunk_tokens if chunk_tokens else None
    return Summary(
        mode=run.mode, completed=len(ok), failed=len(run.records) - len(ok), duration_s=run.duration_s,
        total_input_tokens=n_in, total_output_tokens=n_out, request_throughput=per_s(len(ok)),
        output_throughput=per_s(n_out), total_token_throughput=per_s(n_in + n_out),
        ttft_ms=_stats_ms([r.ttft_s for r in ok]), tpot_ms=_stats_ms(tpots),
        itl_ms=_stats_ms([g for r in ok for g in r.itl_s]), e2el_ms=_stats_ms([r.e2el_s for r in ok]),
        goodput=None if slo is None else per_s(sum(slo.met(r) for r in ok)),
        slo=None if slo is None else asdict(slo), chunk_tokens=chunk_tokens, hit_ratio=hit,
        tier_hit_ratios=tier_ratios, stage_p50_ms=_stage_ms(ok, np.median), stage_mean_ms=_stage_ms(ok, np.mean),
        **_steady(ok))


def _steady(ok: Sequence[RequestRecord]) -> dict:
    """The ``steady_*`` fields of Summary over successful records (definition: module docstring)."""
    none = {"steady_window_s": None, "steady_completed": 0, "steady_request_throughput": None,
            "steady_output_throughput": None, "steady_total_token_throughput": None}
    if not ok:
        return none
    done = sorted(ok, key=lambda r: r.sent_s + r.e2el_s)
    start, end = done[0].sent_s + done[0].e2el_s, max(r.sent_s for r in ok)
    inside = [r for r in done if r.sent_s + r.e2el_s <= end]   # all at or after ``start`` (sorted)
    window = end - start
    if window <= 0 or len(inside) < 2:
        return {**none, "steady_window_s": window if window > 0 else None, "steady_completed": len(inside)}
    counted = inside[1:]                                       # the opening completion is not counted
    n_out = sum(r.output_tokens for r in counted)
    return {"steady_window_s": window, "steady_completed": len(inside),
            "steady_request_throughput": len(counted) / window, "steady_output_throughput": n_out / window,
            "steady_total_token_throughput": (n_out + sum(r.input_tokens for r in counted)) / window}


def _stage_ms(records, reduce) -> dict:
    """Serving stage -> ``reduce`` of its seconds over the records reporting it, in ms."""
    stages: dict[str, list[float]] = {}
    for r in records:
        for name, sec in r.stage_s.items():
            stages.setdefault(name, []).append(sec)
    return {name: float(reduce(v)) * 1000.0 for name, v in stages.items()}
