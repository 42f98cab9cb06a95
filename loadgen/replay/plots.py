"""PNG plots of replays: TTFT CDF per mode, chunk hit ratio over time per mode."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from loadgen.replay.runner import ReplayRun
from loadgen.replay.target import MISS_TIER


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt
    return plt


def ttft_cdf(runs: Sequence[ReplayRun], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for run in runs:
        ttft = np.sort([r.ttft_s * 1e3 for r in run.records if r.ok])
        if ttft.size:
            ax.step(ttft, np.arange(1, ttft.size + 1) / ttft.size, where="post", label=run.mode)
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(title="mode")
    ax.set_title("Time to first token")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def hit_ratio_series(run: ReplayRun, bins: int = 20) -> tuple[np.ndarray, np.ndarray]:
    """(bin centres in s, chunk-token hit ratio of the requests sent in each bin); empty bins dropped."""
    recs = [r for r in run.records if r.ok and r.tier_tokens and r.chunk_tokens]
    if not recs:
        return np.array([]), np.array([])
    sent = np.array([r.sent_s for r in recs])
    hits = np.array([r.chunk_tokens - r.tier_tokens.get(MISS_TIER, 0) for r in recs], dtype=np.float64)
    total = np.array([r.chunk_tokens for r in recs], dtype=np.float64)
    edges = np.linspace(0.0, max(sent.max(), 1e-9), bins + 1)
    which = np.clip(np.searchsorted(edges, sent, side="right") - 1, 0, bins - 1)
    h = np.bincount(which, hits, bins)
    t = np.bincount(which, total, bins)
    keep = t > 0
    return ((edges[:-1] + edges[1:]) / 2)[keep], (h[keep] / t[keep])


def hit_ratio_over_time(runs: Sequence[ReplayRun], path: Path, bins: int = 20) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for run in runs:
        x, y = hit_ratio_series(run, bins)
        if x.size:
            ax.plot(x, 100 * y, marker="o", markersize=3, label=run.mode)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("chunk tokens served from cache (%)")
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    ax.legend(title="mode")
    ax.set_title("Chunk KV hit ratio over time")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
