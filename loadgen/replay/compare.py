"""Replay one trace in several modes, one after another, each from a cold cache."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Sequence

from loadgen.replay.metrics import Slo, Summary, summarize
from loadgen.replay.runner import ReplayConfig, ReplayRun, replay
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
        with tqdm(total=len(trace), desc=mode_cfg.mode, unit="req", disable=not show) as bar:
            run = replay(trace, target, mode_cfg, on_done=lambda _r: bar.update())
        runs.append(run)
        summaries.append(summarize(run, slo))
    return runs, summaries
