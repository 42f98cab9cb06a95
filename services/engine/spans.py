"""Named spans in a profiled worker's trace (bench/cluster/profile_summary.py reads the ``tessera.*`` ones)."""

from __future__ import annotations

import contextlib

import torch


def span(name: str):
    """``record_function(name)`` while a torch profiler records (services/cluster/profiling.py's window); else a
    no-op context: a span is two dispatcher calls, each a turn of the interpreter lock, and a decode worker's
    admissions and steps sit on its engine thread's hot path."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
