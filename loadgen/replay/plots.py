"""PNG plots of replays: TTFT CDF per mode, chunk hit ratio over time per mode, and where the
serving time went per mode (when the target reports its stages)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from loadgen.replay.runner import ReplayRun
from loadgen.replay.target import Tier


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
    if ax.get_legend_handles_labels()[0]:   # a run whose every request failed draws no line
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
    hits = np.array([sum(n for t, n in r.tier_tokens.items() if t != Tier.COMPUTED) for r in recs],
                    dtype=np.float64)   # as summarize: a token missing from the stats is no hit
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
    if ax.get_legend_handles_labels()[0]:   # a run whose every request failed draws no line
        ax.legend(title="mode")
    ax.set_title("Chunk KV hit ratio over time")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# (label, how to get it from the stage medians): the segments of a request's way to its first token, then
# the hand-off that follows it; medians of each stage, so the bar shows typical shares, not one request
STAGE_SEGMENTS = (
    ("queue", lambda m: m.get("queue", 0.0)),
    ("chunk compute", lambda m: m.get("chunk compute", 0.0)),
    ("rest of the pass to the first token", lambda m: max(0.0, m.get("first token", 0.0) - m.get("chunk compute", 0.0))),
    ("hand-off (after the first token)", lambda m: m.get("hand-off", 0.0)),
)


def serving_stages(summaries, path: Path) -> Path | None:
    """Stacked bars of the median serving stages per mode; None (no file) when no mode reports stages."""
    rows = [(s.mode, s.stage_p50_ms) for s in summaries if s.stage_p50_ms]
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.2, 0.6 * len(rows) + 1.8), dpi=120)
    y = np.arange(len(rows))
    left = np.zeros(len(rows))
    for label, get in STAGE_SEGMENTS:
        width = np.array([get(m) for _, m in rows])
        ax.barh(y, width, left=left, label=label)
        left += width
    ax.set_yticks(y, [mode for mode, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms (median of each stage)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("Where the serving time goes, per mode")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def rate_sweep(rows, path: Path, title: str = "") -> Path:
    """Two panels over the offered rate, one line per mode, from ``report.rate_sweep_rows``: p50 TTFT
    (log scale) and the achieved (steady) request throughput beside the offered one."""
    plt = _pyplot()
    fig, (ttft, done) = plt.subplots(1, 2, figsize=(10.0, 4.0), dpi=120)
    rates = [row["rate"] for row in rows]
    for mode in dict.fromkeys(m for row in rows for m in row["modes"]):
        points = [(row["rate"], row["modes"][mode]) for row in rows if mode in row["modes"]]
        for ax, key in ((ttft, "ttft_p50_ms"), (done, "throughput")):
            xy = [(r, p[key]) for r, p in points if p[key] is not None]
            if xy:
                ax.plot(*zip(*xy), marker="o", markersize=4, label=mode)
    if rates:
        done.plot([0, max(rates)], [0, max(rates)], color="grey", linestyle="--", linewidth=1, label="offered")
    ttft.set_yscale("log")
    ttft.set_ylabel("p50 TTFT (ms, log scale)")
    done.set_ylabel("achieved throughput (req/s, steady)")
    for ax in (ttft, done):
        ax.set_xlabel("offered rate (req/s, Poisson)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(title="mode", fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
