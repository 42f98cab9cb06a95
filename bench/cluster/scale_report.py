"""Merge bench/cluster/scale.sh's runs (cluster.py JSON files, one per configuration) into one table and a plot:
throughput and TTFT against GPUs and workers, each ratio against the run named by --baseline (one GPU shared by a
prefill and a decode worker), and chunk-residency routing against load-only routing where both ran.

    python3 bench/cluster/scale_report.py --baseline together --out bench/cluster/DATE_DEVICE_COMMIT_scale RUN.json ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows_of(path: Path) -> list[dict]:
    d = json.loads(path.read_text())
    out = []
    runs = d["runs"] or ([{"alpha": d["partial"]["alpha"], "summaries": d["partial"]["summaries"]}]
                         if d.get("partial") else [])
    for run in runs:
        for s in run["summaries"]:
            stages = s.get("stage_p50_ms", {})
            budget = (run.get("time_budget") or {}).get(s["mode"], {})
            out.append({"run": path.stem, "gpus": d.get("gpus"), "prefill": d.get("prefill_workers", 1),
                        "decode": d.get("decode_workers", 1), "routing": d.get("routing", "residency"),
                        "store_shm": d.get("store_shm", "off"),
                        "alpha": run["alpha"], "concurrency": d.get("concurrency"), "completed": s["completed"],
                        "failed": s["failed"], "throughput": s["request_throughput"],
                        "steady": s.get("steady_request_throughput") or s["request_throughput"],
                        "ttft_p50": s["ttft_ms"]["p50"], "ttft_p99": s["ttft_ms"]["p99"],
                        "tpot_p50": s["tpot_ms"]["p50"], "handoff_p50": stages.get("hand-off"),
                        "gpu_tier": (s.get("tier_hit_ratios") or {}).get("gpu"), "transport": d.get("transport", ""),
                        "gpu_busy": budget.get("gpu_busy_pct"), "step_ms": budget.get("decode_step_mean_ms"),
                        "batch": budget.get("decode_mean_batch"), "decode_cpu": budget.get("decode_cpu_pct"),
                        "prefill_ms": budget.get("prefill_mean_ms"), "admit_ms": budget.get("admit_mean_ms"),
                        # hand-offs to another GPU's decode worker; hand-offs sent back at admission to have evicted
                        # chunks read off the engine thread, and chunks admissions still read on it
                        "peer": (budget.get("handoffs_by_transport") or {}).get("cuda-ipc-peer", 0.0),
                        "restaged": budget.get("decode_restaged"), "admission_reads": budget.get("decode_admission_reads"),
                        "date": d["date"], "commit": d.get("commit", ""), "device": d.get("gpu", "")})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--baseline", default="together", help="the run every throughput is divided by")
    ap.add_argument("--out", required=True, help="writes OUT.md, OUT.json and OUT.png")
    args = ap.parse_args()
    rows = [r for p in args.runs for r in rows_of(p)]
    if not rows:
        raise SystemExit("no finished run in the files given")
    base = {r["alpha"]: r for r in rows if r["run"] == args.baseline}
    lines = ["| run | GPUs | prefill + decode | routing | store shm | alpha | clients | done / failed | req/s (steady) | "
             f"x {args.baseline} | TTFT p50 / p99 ms | TPOT p50 ms | hand-off p50 ms | chunk tokens on GPU "
             "| decode step ms (batch) | GPU busy | decode worker CPU | prefill ms | admission ms | peer hand-offs "
             "| restaged / read at admission |",
             "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        b = base.get(r["alpha"])
        ratio = f"{r['steady'] / b['steady']:.2f}x" if b else "-"
        hand = f"{r['handoff_p50']:.1f}" if r["handoff_p50"] is not None else "-"
        tier = f"{100 * r['gpu_tier']:.0f}%" if r["gpu_tier"] is not None else "-"
        lines.append(f"| {r['run']} | {r['gpus']} | {r['prefill']} + {r['decode']} | {r['routing']} | {r['store_shm']} | {r['alpha']:g} | "
                     f"{r['concurrency']} | {r['completed']} / {r['failed']} | {r['throughput']:.2f} "
                     f"({r['steady']:.2f}) | {ratio} | {r['ttft_p50']:,.0f} / {r['ttft_p99']:,.0f} | "
                     f"{r['tpot_p50']:.1f} | {hand} | {tier} | {_num(r['step_ms'], '{:.1f}')} "
                     f"({_num(r['batch'], '{:.1f}')}) | {_num(r['gpu_busy'], '{:.0f}%')} "
                     f"| {_num(r['decode_cpu'], '{:.0f}%')} | {_num(r['prefill_ms'], '{:.1f}')} "
                     f"| {_num(r['admit_ms'], '{:.1f}')} | {_num(r['peer'], '{:.0f}')} "
                     f"| {_num(r['restaged'], '{:.0f}')} / {_num(r['admission_reads'], '{:.0f}')} |")
    ab = []
    for r in rows:
        if r["routing"] != "residency":
            continue
        peer = [q for q in rows if q["routing"] == "load" and q["alpha"] == r["alpha"] and q["gpus"] == r["gpus"]
                and (q["prefill"], q["decode"], q["store_shm"]) == (r["prefill"], r["decode"], r["store_shm"])]
        for q in peer:
            ab.append(f"- {r['gpus']} GPUs, alpha {r['alpha']:g}: TTFT p50 load-only / residency "
                      f"**{q['ttft_p50'] / r['ttft_p50']:.2f}x** ({q['ttft_p50']:,.0f} against {r['ttft_p50']:,.0f} ms), "
                      f"p99 {q['ttft_p99'] / r['ttft_p99']:.2f}x; throughput residency / load-only "
                      f"{r['steady'] / q['steady']:.2f}x")
    widest = max(rows, key=lambda r: r['gpus'])   # the host's device line, not the one-GPU baseline's
    md = [f"# Scale-out: {widest['device']}, commit {rows[0]['commit']}", "",
          f"Runs from {min(r['date'] for r in rows)} to {max(r['date'] for r in rows)}. Transport: "
          f"{rows[0]['transport']}.", "", "\n".join(lines), ""]
    if ab:
        md += ["Chunk-residency routing against load-only routing:", ""] + ab + [""]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.md").write_text("\n".join(md))
    Path(f"{args.out}.json").write_text(json.dumps(rows, indent=2))
    _plot(rows, Path(f"{args.out}.png"))
    print("\n".join(md))
    return 0


def _num(v, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for alpha in sorted({r["alpha"] for r in rows}):
        for routing, style in (("residency", "o-"), ("load", "s--")):
            for shm in ("on", "off"):
                pts = sorted((r["gpus"], r["steady"], r["ttft_p50"]) for r in rows
                             if r["alpha"] == alpha and r["routing"] == routing and r["prefill"] == r["decode"]
                             and r["store_shm"] == shm)
                label = f"alpha {alpha:g}, {routing}, store shm {shm}"
                if pts:
                    ax1.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label, alpha=1.0 if shm == "on" else 0.5)
                    ax2.plot([p[0] for p in pts], [p[2] for p in pts], style, label=label, alpha=1.0 if shm == "on" else 0.5)
    ax1.set(xlabel="GPUs (a prefill and a decode worker each)", ylabel="requests/s (steady)", title="Throughput")
    ax2.set(xlabel="GPUs (a prefill and a decode worker each)", ylabel="ms", title="TTFT p50")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
