"""Replay one trace in several modes, one after another, each from a cold cache; or in one mode at
several open-loop rates, one after another, after one cold start."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Sequence

from loadgen.replay.metrics import Slo, Summary, summarize
from loadgen.replay.runner import ReplayConfig, ReplayRun, replay, selected
from loadgen.replay.target import ReplayTarget
from loadgen.trace.model import TraceRequest


def replay_modes(trace: Sequence[TraceRequest], target: ReplayTarget, cfg: ReplayConfig,
                 modes: Sequence[str], slo: Slo | None = None,
                 progress: bool | None = None) -> tuple[list[ReplayRun], list[Summary]]:
    """Replay ``trace`` once per mode (``cfg`` with its mode replaced); ``target.reset()``, when
    the target has one, runs before each mode. ``progress``: a tqdm bar (default: on a terminal)."""
    from tqdm import tqdm

    configs = [replace(cfg, mode=m) for m in modes]   # refuses an unknown mode before any work
    show = sys.stderr.isatty() if progress is None else progress
    runs, summaries = [], []
    for mode_cfg in configs:
        if callable(getattr(target, "reset", None)):
            target.reset()
        with tqdm(total=len(selected(trace, mode_cfg)), desc=mode_cfg.mode, unit="req",
                  disable=not show) as bar:
            run = replay(trace, target, mode_cfg, on_done=lambda _r: bar.update())
        runs.append(run)
        summaries.append(summarize(run, slo))
    return runs, summaries


def replay_rates(trace: Sequence[TraceRequest], target: ReplayTarget, cfg: ReplayConfig,
                 rates: Sequence[float], duration_s: float | None = None, slo: Slo | None = None,
                 progress: bool | None = None) -> tuple[list[ReplayRun], list[Summary]]:
    """Replay ``trace`` open loop at each of ``rates`` (req/s, in the order given) in ``cfg.mode``.

    ``target.reset()``, when the target has one, runs ONCE, before the first rate: a set-up that
    is costly (a corpus registration) is not repeated, and each later rate starts from the caches
    the earlier ones left. ``duration_s`` stops sending after that many seconds of a rate (the
    requests in flight end), so that a rate past the target's capacity takes bounded time.
    """
    from tqdm import tqdm

    configs = [replace(cfg, rate=r, concurrency=None, duration_s=duration_s) for r in rates]  # refuses bad rates first
    show = sys.stderr.isatty() if progress is None else progress
    if callable(getattr(target, "reset", None)):
        target.reset()
    runs, summaries = [], []
    for rate_cfg in configs:
        with tqdm(total=len(selected(trace, rate_cfg)), desc=f"{rate_cfg.mode} {rate_cfg.rate:g} req/s",
                  unit="req", disable=not show) as bar:
            run = replay(trace, target, rate_cfg, on_done=lambda _r: bar.update())
        runs.append(run)
        summaries.append(summarize(run, slo))
    return runs, summaries
