"""Host time of real ratio-0 passes on a GPU: when the graph replay is issued, and what Python's garbage collector
costs there (issue #2's `tessera@0`).

bench/engine_host/host_pieces.py times each host step in a hot loop; inside a real pass the host has just waited ~7 ms for
the GPU and each step costs more. This runs real `tessera@0` passes of bench/engine/engine.py's request (6 chunks x 512
tokens + a 64-token suffix, every chunk resident) on the Llama-3-8B shape with random weights, and stamps the
time from the call to the graph replay (``issue``: the GPU idles until then) and to the GPU's end (``wall``),
medians over --reps passes, for each variant, alternating --rounds times in one process:

  default   as the engine runs
  freeze    gc.freeze() after warm-up: every object alive then moves out of the collector's generations
  gc_off    the collector disabled for the timed passes (gc.disable(); re-enabled after)

Gen-0 collections are triggered by allocation counts, so a pass that allocates pays for one now and then;
the medians show whether that shifts the typical pass, the maxima whether it makes outliers.

    python3 bench/engine_host/host_real.py [--reps 50] [--rounds 3] [--out DIR/host_real.json]

Outcome (H100, 2026-11-22, bench/engine_host/2026-11-22_h100_4a18120_real.json, 120 passes a variant): no gen-0 collection during the timed
passes; replay issued 0.456 / 0.473 / 0.463 ms into the call (default / freeze / gc_off), wall 7.16 ms for all
three: the collector is not where the host's time goes.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_ops import bench_request, build_engine  # noqa: E402

VARIANTS = ("default", "freeze", "gc_off")


def passes(eng, chunks, suffix, reps: int) -> dict:
    """Issue and wall times (ms) of reps tessera@0 passes, and the collector's gen-0 runs during them."""
    call = lambda: eng.prefill(chunks, suffix, mode="tessera", recompute_ratio=0.0)  # noqa: E731
    seen = []
    replay = torch.cuda.CUDAGraph.replay
    torch.cuda.CUDAGraph.replay = lambda graph: (seen.append(time.perf_counter()), replay(graph))[1]
    issues, walls = [], []
    gen0 = gc.get_stats()[0]["collections"]
    try:
        for _ in range(reps):
            torch.cuda.synchronize()
            seen.clear()
            t0 = time.perf_counter()
            call()
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) * 1e3)
            issues.append((seen[0] - t0) * 1e3)
    finally:
        torch.cuda.CUDAGraph.replay = replay
    return {"issue_ms": issues, "wall_ms": walls, "gen0_collections": gc.get_stats()[0]["collections"] - gen0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    eng = build_engine(argparse.Namespace(device="cuda", layers=args.layers, hidden=None), "triton")
    chunks, suffix = bench_request(128000)
    for _ in range(5):
        eng.prefill(chunks, suffix, mode="tessera", recompute_ratio=0.0)
    torch.cuda.synchronize()
    rec = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "reps": args.reps, "variants": {}}
    for r in range(args.rounds):
        for name in VARIANTS:
            if name == "freeze":
                gc.freeze()
            elif name == "gc_off":
                gc.disable()
            try:
                got = passes(eng, chunks, suffix, args.reps)
            finally:
                gc.enable()
                gc.unfreeze()
            row = rec["variants"].setdefault(name, {"issue_ms": [], "wall_ms": [], "gen0_collections": 0})
            row["issue_ms"] += got["issue_ms"]
            row["wall_ms"] += got["wall_ms"]
            row["gen0_collections"] += got["gen0_collections"]
            print(f"round {r + 1} {name:8s} issue median {statistics.median(got['issue_ms']):.3f} ms "
                  f"(max {max(got['issue_ms']):.3f}), wall median {statistics.median(got['wall_ms']):.3f} ms "
                  f"(max {max(got['wall_ms']):.3f}), gen-0 collections {got['gen0_collections']}", flush=True)
    for name, row in rec["variants"].items():
        row["issue_median_ms"] = statistics.median(row["issue_ms"])
        row["wall_median_ms"] = statistics.median(row["wall_ms"])
        print(f"{name:8s} issue {row['issue_median_ms']:.3f} ms, wall {row['wall_median_ms']:.3f} ms over "
              f"{len(row['wall_ms'])} passes", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rec, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
