"""Where a worker's engine thread spent a profiled window: a summary of one TESSERA_TORCH_PROFILE trace.

    python3 bench/cluster/profile_summary.py DIR/tessera-prefill-0-1234.json.gz [--units NAME] [--json OUT]

For the busiest host thread (the engine thread): its wall span, the time covered by torch ops (the
outermost ones), the rest (Python between ops, or waiting for the interpreter lock while other threads
hold it), the host syncs by the op that made them (``cudaStreamSynchronize`` and friends: time the
thread stood waiting for the GPU), the named spans the workers mark (``tessera.*``: a decode worker's admissions
and steps, with the host syncs inside them) and the heaviest outermost ops; for the process's GPU work: the
time some kernel or copy of this process ran (the union of their intervals) against the span, and
kernel and copy totals. ``--units aten::item`` also splits the span at each call of that op (the
prefill worker's first-token read) and reports the median unit.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path

HOST = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation", "python_function")
GPU = ("kernel", "gpu_memcpy", "gpu_memset")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def outermost(events: list[dict]) -> list[dict]:
    out, end = [], float("-inf")
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e["dur"]
    return out


def union_us(events: list[dict]) -> float:
    total, cur = 0.0, None
    for a, b in sorted((e["ts"], e["ts"] + e["dur"]) for e in events):
        if cur is None or a > cur[1]:
            if cur is not None:
                total += cur[1] - cur[0]
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    return total + (cur[1] - cur[0] if cur else 0.0)


def summarize(events: list[dict], units: str | None = None) -> dict:
    host = [e for e in events if e.get("cat") in HOST]
    busy = Counter()
    for e in host:
        busy[e["tid"]] += e["dur"]
    tid = busy.most_common(1)[0][0]
    mine = [e for e in host if e["tid"] == tid]
    top = outermost(mine)
    span = top[-1]["ts"] + top[-1]["dur"] - top[0]["ts"]
    covered = sum(e["dur"] for e in top)
    ops = [e for e in mine if e.get("cat") in ("cpu_op", "user_annotation", "python_function")]
    syncs: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for s in (e for e in mine if e["name"] in SYNCS):
        inside = [o for o in ops if o["ts"] <= s["ts"] and o["ts"] + o["dur"] >= s["ts"] + s["dur"]]
        by = min(inside, key=lambda o: o["dur"])["name"] if inside else s["name"]
        syncs[by][0] += 1
        syncs[by][1] += s["dur"] / 1e3
    heavy: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in top:
        heavy[e["name"]][0] += 1
        heavy[e["name"]][1] += e["dur"] / 1e3
    # the workers' named spans (record_function "tessera.*": an admission, a decode step, an import's parts): their
    # time on the engine thread and the host syncs inside them
    spans: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    sync_events = [e for e in mine if e["name"] in SYNCS]
    for e in (o for o in mine if o["name"].startswith("tessera.")):
        spans[e["name"]][0] += 1
        spans[e["name"]][1] += e["dur"] / 1e3
        spans[e["name"]][2] += sum(x["dur"] for x in sync_events
                                   if x["ts"] >= e["ts"] and x["ts"] + x["dur"] <= e["ts"] + e["dur"]) / 1e3
    gpu = [e for e in events if e.get("cat") in GPU]
    out = {
        "engine_thread": tid, "span_ms": span / 1e3, "in_torch_ops_ms": covered / 1e3,
        "between_ops_ms": (span - covered) / 1e3,
        "host_syncs": {k: {"count": int(v[0]), "ms": round(v[1], 3)} for k, v in
                       sorted(syncs.items(), key=lambda kv: -kv[1][1])},
        "heaviest_ops": {k: {"count": int(v[0]), "ms": round(v[1], 3)} for k, v in
                         sorted(heavy.items(), key=lambda kv: -kv[1][1])[:15]},
        "spans": {k: {"count": int(v[0]), "ms": round(v[1], 3), "sync_ms": round(v[2], 3)} for k, v in
                  sorted(spans.items(), key=lambda kv: -kv[1][1])},
        "gpu_busy_ms": union_us(gpu) / 1e3,
        "kernel_ms": sum(e["dur"] for e in gpu if e["cat"] == "kernel") / 1e3,
        "copy_ms": sum(e["dur"] for e in gpu if e["cat"] == "gpu_memcpy") / 1e3,
    }
    if units:
        marks = [e["ts"] + e["dur"] for e in top if e["name"] == units]
        lengths = [(b - a) / 1e3 for a, b in zip(marks, marks[1:])]
        if lengths:
            out["units"] = {"op": units, "count": len(lengths), "median_ms": statistics.median(lengths)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--units", help="an op marking the end of each unit of work (e.g. aten::item)")
    ap.add_argument("--json", type=Path, help="also write the summary here")
    args = ap.parse_args()
    s = summarize(load(args.trace), args.units)
    print(f"{args.trace.name}: engine thread {s['engine_thread']}, span {s['span_ms']:.1f} ms: "
          f"{s['in_torch_ops_ms']:.1f} ms in torch ops, {s['between_ops_ms']:.1f} ms between them")
    if "units" in s:
        print(f"  {s['units']['count']} units, median {s['units']['median_ms']:.2f} ms")
    print(f"  GPU (this process): busy {s['gpu_busy_ms']:.1f} ms of the span; kernels {s['kernel_ms']:.1f} ms, "
          f"copies {s['copy_ms']:.1f} ms")
    print("  host syncs by op: " + (", ".join(f"{k} {v['count']}x {v['ms']:.1f} ms" for k, v in s["host_syncs"].items())
                                     or "none"))
    print("  named spans: " + (", ".join(f"{k} {v['count']}x {v['ms']:.1f} ms ({v['sync_ms']:.1f} waiting on the GPU)"
                                         for k, v in s["spans"].items()) or "none"))
    print("  heaviest outermost ops: " + ", ".join(f"{k} {v['count']}x {v['ms']:.1f} ms"
                                                   for k, v in list(s["heaviest_ops"].items())[:8]))
    if args.json:
        args.json.write_text(json.dumps(s, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
