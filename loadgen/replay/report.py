"""Writing a replay's results: per-request JSONL, summaries, one side-by-side table, plots.

Layout under the output folder:
  <mode>/requests.jsonl   one JSON object per request (RequestRecord fields)
  <mode>/summary.json     that mode's Summary
  summary.md / .json      every mode side by side, with the command that made them
  ttft_cdf.png, hit_ratio_over_time.png
An open-loop rate sweep (several offered rates per mode) has its own rows and table: ``rate_sweep_rows``.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Mapping, Sequence

from loadgen.replay.metrics import PERCENTILES, Summary
from loadgen.replay.plots import hit_ratio_over_time, serving_stages, ttft_cdf
from loadgen.replay.runner import ReplayRun


def _num(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.2f}"


def summary_rows(summaries: Sequence[Summary]) -> list[tuple[str, list[str]]]:
    """(metric label, one cell per mode) in the order of ``vllm bench serve``'s report."""
    rows = [
        ("Successful requests", [str(s.completed) for s in summaries]),
        ("Failed requests", [str(s.failed) for s in summaries]),
        ("Duration (s)", [_num(s.duration_s) for s in summaries]),
        ("Request throughput (req/s)", [_num(s.request_throughput) for s in summaries]),
        # while the load was on: between the first completion and the last send (metrics module docstring)
        ("Request throughput, steady (req/s)", [_num(s.steady_request_throughput) for s in summaries]),
        ("Output token throughput (tok/s)", [_num(s.output_throughput) for s in summaries]),
        ("Total token throughput (tok/s)", [_num(s.total_token_throughput) for s in summaries]),
        ("Total token throughput, steady (tok/s)", [_num(s.steady_total_token_throughput) for s in summaries]),
    ]
    if any(s.goodput is not None for s in summaries):
        slo = next(s.slo for s in summaries if s.slo)
        spec = ", ".join(f"{k[:-3]} <= {v:g} ms" for k, v in slo.items() if v is not None)
        rows.append((f"Goodput (req/s, {spec})", [_num(s.goodput) for s in summaries]))
    for name, attr in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2EL", "e2el_ms")):
        for stat in ("mean", *(f"p{p}" for p in PERCENTILES)):
            rows.append((f"{name} {stat} (ms)", [_num(getattr(s, attr)[stat]) for s in summaries]))
    rows.append(("Chunk hit ratio (%)", [_pct(s.hit_ratio) for s in summaries]))
    tiers = list(dict.fromkeys(t for s in summaries for t in s.tier_hit_ratios))
    for tier in tiers:
        rows.append((f"  chunk tokens from {tier} (%)", [_pct(s.tier_hit_ratios.get(tier)) for s in summaries]))
    for stage in dict.fromkeys(k for s in summaries for k in s.stage_p50_ms):
        rows.append((f"Stage p50 (ms): {stage}", [_num(s.stage_p50_ms.get(stage)) for s in summaries]))
    for stage in dict.fromkeys(k for s in summaries for k in s.stage_mean_ms):
        rows.append((f"Stage mean (ms): {stage}", [_num(s.stage_mean_ms.get(stage)) for s in summaries]))
    if len(summaries) > 1:
        base = summaries[0]
        def ratio(a: float | None, b: float | None) -> str:
            return "-" if not a or not b else f"{a / b:.2f}x"
        rows.append((f"p50 TTFT speed-up vs {base.mode}",
                     [ratio(base.ttft_ms["p50"], s.ttft_ms["p50"]) for s in summaries]))
        rows.append((f"Throughput vs {base.mode}",
                     [ratio(s.total_token_throughput, base.total_token_throughput) for s in summaries]))
        rows.append((f"Steady throughput vs {base.mode}",
                     [ratio(s.steady_total_token_throughput, base.steady_total_token_throughput) for s in summaries]))
    return rows


def summary_table(summaries: Sequence[Summary]) -> str:
    """Markdown: one row per metric, one column per mode."""
    lines = ["| metric | " + " | ".join(s.mode for s in summaries) + " |",
             "|---" + "|---:" * len(summaries) + "|"]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in summary_rows(summaries)]
    return "\n".join(lines)


# A ratio of the rate table: (metric, numerator mode, denominator mode); metric is one of RATE_RATIO_METRICS.
RateRatio = tuple[str, str, str]
RATE_RATIO_METRICS = {"ttft_p50": ("ttft_p50_ms", "p50 TTFT"), "throughput": ("throughput", "req/s")}


def rate_point(s: Summary) -> dict:
    """One mode at one offered rate, JSON-ready. throughput: the achieved rate, i.e. the steady request
    throughput (completions per second while requests were still being sent; None when fewer than two
    requests completed before the last send: a short trace sent faster than the target serves);
    throughput_whole_run: completed / duration, drain included; sent: requests sent, fewer than the trace
    when a time limit stopped sending; completed: those that succeeded."""
    return {"ttft_p50_ms": s.ttft_ms["p50"], "ttft_p90_ms": s.ttft_ms["p90"],
            "throughput": s.steady_request_throughput, "throughput_whole_run": s.request_throughput,
            "completed": s.completed, "sent": s.completed + s.failed}


def rate_sweep_rows(sweep: Mapping[float, Mapping[str, Summary]],
                    ratios: Sequence[RateRatio] = ()) -> list[dict]:
    """``sweep``: offered rate -> mode -> Summary. One JSON-ready row per rate, lowest first:
    {"rate", "modes": {mode: rate_point}, "ratios": {"METRIC A/B": value or None}}; a ratio is None
    where either mode is missing at that rate or has no value."""
    for metric, _, _ in ratios:
        if metric not in RATE_RATIO_METRICS:
            raise ValueError(f"unknown rate-table metric {metric!r}; use {', '.join(RATE_RATIO_METRICS)}")
    rows = []
    for rate in sorted(sweep):
        points = {mode: rate_point(s) for mode, s in sweep[rate].items()}
        values = {}
        for metric, a, b in ratios:
            key = RATE_RATIO_METRICS[metric][0]
            x, y = points.get(a, {}).get(key), points.get(b, {}).get(key)
            values[f"{metric} {a}/{b}"] = None if x is None or not y else x / y
        rows.append({"rate": rate, "modes": points, "ratios": values})
    return rows


def rate_sweep_table(rows: Sequence[dict]) -> str:
    """Markdown of ``rate_sweep_rows``: a row per offered rate; per mode p50 and p90 TTFT, achieved
    req/s (in parentheses the whole run's completed / duration where the steady rate is None) and
    completed/sent requests; then the ratios (of steady rates only)."""
    modes = list(dict.fromkeys(m for row in rows for m in row["modes"]))
    ratios = list(dict.fromkeys(k for row in rows for k in row["ratios"]))
    head = ["offered (req/s)"]
    for m in modes:
        head += [f"{m} p50 TTFT (ms)", f"{m} p90 TTFT (ms)", f"{m} achieved (req/s)", f"{m} done/sent"]
    for key in ratios:
        metric, _, pair = key.partition(" ")
        head.append(f"{RATE_RATIO_METRICS[metric][1]} {pair}")
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for row in rows:
        cells = [f"{row['rate']:g}"]
        for m in modes:
            p = row["modes"].get(m)
            cells += (["-"] * 4 if p is None else
                      [_num(p["ttft_p50_ms"], 1), _num(p["ttft_p90_ms"], 1), _achieved(p),
                       f"{p['completed']}/{p['sent']}"])
        cells += ["-" if row["ratios"].get(k) is None else f"{row['ratios'][k]:.2f}x" for k in ratios]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _achieved(point: dict) -> str:
    if point["throughput"] is None and point.get("throughput_whole_run") is not None:
        return f"({point['throughput_whole_run']:.2f})"
    return _num(point["throughput"])


def write_run(out_dir: Path, run: ReplayRun, summary: Summary) -> Path:
    folder = Path(out_dir) / run.mode
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "requests.jsonl").open("w", encoding="utf-8") as f:
        for rec in run.records:
            f.write(json.dumps(asdict(rec)) + "\n")
    (folder / "summary.json").write_text(json.dumps(summary.to_json(), indent=1) + "\n")
    return folder


def write_report(out_dir: Path, runs: Sequence[ReplayRun], summaries: Sequence[Summary],
                 command: str, about: str = "") -> dict[str, Path]:
    """Everything in the module docstring; returns the paths of the shared files."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for run, summary in zip(runs, summaries):
        write_run(out_dir, run, summary)
    table = summary_table(summaries)
    md = "\n".join(["# Replay results", "", f"Command: `{command}`", "", *([about, ""] if about else []),
                    table, "", "![TTFT CDF](ttft_cdf.png)", "",
                    "![hit ratio over time](hit_ratio_over_time.png)", ""])
    paths = {"summary_md": out_dir / "summary.md", "summary_json": out_dir / "summary.json",
             "ttft_cdf": out_dir / "ttft_cdf.png", "hit_ratio": out_dir / "hit_ratio_over_time.png"}
    paths["summary_md"].write_text(md)
    paths["summary_json"].write_text(json.dumps(
        {"command": command, "about": about, "modes": [s.to_json() for s in summaries]}, indent=1) + "\n")
    ttft_cdf(runs, paths["ttft_cdf"])
    hit_ratio_over_time(runs, paths["hit_ratio"])
    stages = serving_stages(summaries, out_dir / "serving_stages.png")
    if stages is not None:
        paths["stages"] = stages
        paths["summary_md"].write_text(md + "\n![serving stages](serving_stages.png)\n")
    return paths
