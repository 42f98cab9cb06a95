"""Writing a replay's results: per-request JSONL, summaries, one side-by-side table, plots.

Layout under the output folder:
  <mode>/requests.jsonl   one JSON object per request (RequestRecord fields)
  <mode>/summary.json     that mode's Summary
  summary.md / .json      every mode side by side, with the command that made them
  ttft_cdf.png, hit_ratio_over_time.png
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

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
        ("Output token throughput (tok/s)", [_num(s.output_throughput) for s in summaries]),
        ("Total token throughput (tok/s)", [_num(s.total_token_throughput) for s in summaries]),
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
    return rows


def summary_table(summaries: Sequence[Summary]) -> str:
    """Markdown: one row per metric, one column per mode."""
    lines = ["| metric | " + " | ".join(s.mode for s in summaries) + " |",
             "|---" + "|---:" * len(summaries) + "|"]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in summary_rows(summaries)]
    return "\n".join(lines)


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
