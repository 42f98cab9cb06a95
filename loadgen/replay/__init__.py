"""Trace replay against a target (the cluster through its SDK, or a fake), metrics, reports, plots."""

from loadgen.replay.compare import replay_modes
from loadgen.replay.metrics import Slo, Summary, summarize
from loadgen.replay.runner import ReplayConfig, ReplayRun, RequestRecord, replay
from loadgen.replay.target import (MODES, TIER_ORDER, ReplayRequest, ReplayTarget, RequestStats,
                                   StreamEvent)

__all__ = ["replay_modes", "Slo", "Summary", "summarize", "ReplayConfig", "ReplayRun", "RequestRecord", "replay",
           "MODES", "TIER_ORDER", "ReplayRequest", "ReplayTarget", "RequestStats", "StreamEvent"]
