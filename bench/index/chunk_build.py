"""A chunk's retrieval indexes built on the host's cores (what a request whose chunks are new waits for), the build as
it is against the build of the day before, in one run: an 8B-shaped chunk (32 layers x 8 KV heads, 512 keys of
head_dim 128, random normal) with 512 training queries a head, ``ChunkIndex.build`` on every core.

Variants, timed in turn (--rounds times each, medians):
- ``now``: the defaults (no repair round of the chunk's own, each key's exact top keys in the build's step 3);
- ``before``: 2 repair rounds and step 3 by graph searches (``build.EXACT_CANDIDATES`` = 0), as on 2026-11-28 before
  7c3ceff and 490c071.

    python3 bench/index/chunk_build.py --out F
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.index import build  # noqa: E402
from services.index.chunks import ChunkIndex  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--keys", type=int, default=512)
    ap.add_argument("--queries", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    keys = [rng.standard_normal((args.heads, args.keys, 128), dtype=np.float32) for _ in range(args.layers)]
    train = [rng.standard_normal((args.heads, args.queries, 128), dtype=np.float32) for _ in range(args.layers)]
    cores = len(os.sched_getaffinity(0))
    exact = build.EXACT_CANDIDATES
    variants = {"now": ({}, exact), "before": ({"repair_rounds": 2}, 0)}
    ChunkIndex.build(keys[:1], train[:1])                      # compiles
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (options, limit) in variants.items():
            build.EXACT_CANDIDATES = limit
            try:
                t0 = time.perf_counter()
                ChunkIndex.build(keys, train, **options)
                times[name].append(time.perf_counter() - t0)
            finally:
                build.EXACT_CANDIDATES = exact
    graphs = args.layers * args.heads
    results = {"date": time.strftime("%Y-%m-%d"), "cores": cores, "commit": os.environ.get("TESSERA_COMMIT", ""),
               "command": "python3 " + " ".join(sys.argv), "layers": args.layers, "heads": args.heads,
               "keys": args.keys, "queries": args.queries,
               "rows": [{"variant": name, "seconds_a_chunk": statistics.median(t), "all": t,
                         "ms_a_graph_on_one_core": statistics.median(t) * cores / graphs * 1e3}
                        for name, t in times.items()]}
    for row in results["rows"]:
        print(f"{row['variant']:>7}: {row['seconds_a_chunk']:.2f} s a chunk of {graphs} graphs on {cores} cores "
              f"({row['ms_a_graph_on_one_core']:.1f} ms a graph and core); rounds {[round(t, 2) for t in row['all']]}",
              flush=True)
    now, before = (results["rows"][i]["seconds_a_chunk"] for i in range(2))
    print(f"before / now: {before / now:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
