"""Where a retrieval decode step's CPU time goes at one layer (the host's cores): ``IndexSet.attend`` for one sequence
against the same searches run one after another, and run at once on bare threads.

One owner, an 8B-shaped layer (8 KV heads, 32 query heads, head_dim 128), N random normal keys a KV head (each head's
index built from M random training queries), random queries. Per thread count T it times, medians over --calls calls:

- ``attend``: IndexSet(threads=T).attend(layer, [owner], queries [1, 32, 128], k): what a decode step waits for at
  each layer (its thread pool; a KV head's 4 query heads cut into pieces when 8 heads leave threads idle);
- ``sequential``: the same pieces' searches (``partial_attention``) one after another on the calling thread: the sum
  of their times and the longest one;
- ``bare``: the pieces on T threads started once and released together by a barrier, each calling the compiled
  search directly: the wall of the slowest, with no pool, no checks and no queue between;
- ``native``: the same pieces in one compiled call on numba's threads (``_layer.attend``), no Python between
  them; its answers checked equal to ``partial_attention``'s; ``native_scan`` the same with every piece scanned;
- ``scan``: ``attend`` with every head scanned (``attend_group(scan=True)``: every key's int8 code scored) instead
  of searched on its graph.

efficiency = sequential sum / (T x attend wall): the share of the T threads' time a layer's call keeps busy.

    python3 bench/index/layer_calls.py --keys 31680 --threads 8,16 --out F
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.index.heads import IndexSet, partial_attention  # noqa: E402

HKV, HQ, D = 8, 32, 128


def pieces_of(hq: int, hkv: int, threads: int) -> list[tuple[int, slice]]:
    """(KV head, query rows) of each search IndexSet.attend makes for one row (its piece rule)."""
    pieces = min(hq, max(1, -(-threads // hkv)))
    g = hq // hkv
    size = -(-g // min(g, pieces))
    return [(h, slice(lo, min(lo + size, (h + 1) * g))) for h in range(hkv) for lo in range(h * g, (h + 1) * g, size)]


def bare_wall(heads, queries, jobs, k: int, scale: float, threads: int, calls: int) -> list[float]:
    """Each call: the jobs dealt to ``threads`` threads, released together, each job's compiled search run directly;
    the wall from release to the last one done."""
    bins = [jobs[i::threads] for i in range(threads)]
    start = threading.Barrier(threads + 1)
    done = threading.Barrier(threads + 1)
    stop = False

    def worker(mine):
        while True:
            start.wait()
            if stop:
                return
            for h, rows in mine:
                heads[h].index.attend_group(queries[0, rows][None], heads[h].values, k, scale)
            done.wait()

    pool = [threading.Thread(target=worker, args=(b,), daemon=True) for b in bins]
    for t in pool:
        t.start()
    walls = []
    for _ in range(calls):
        t0 = time.perf_counter()
        start.wait()
        done.wait()
        walls.append(time.perf_counter() - t0)
    stop = True
    start.wait()
    return walls


def native_walls(heads, jobs, k: int, scale: float, calls: int, rng, scan: bool = False) -> tuple[list[float], bool]:
    """Each call: the pieces searched (``scan``: scanned) in one compiled call on numba's threads (``_layer.attend``,
    the arrays made once as ``IndexSet`` makes them); and whether its answers equal the pool's (``partial_attention``)
    for one call."""
    from services.index import _layer

    _layer.warm()
    layers = [_layer.LayerArrays([(heads[h].index, heads[h].values) for h in range(HKV)])]
    row_of = np.zeros(len(jobs), np.int64)
    head_of = np.array([h for h, _ in jobs], np.int64)
    scan_of = np.full(len(jobs), scan)

    def call(q):
        pieces = np.ascontiguousarray(np.stack([q[0, rows] for _, rows in jobs]))
        return _layer.attend(layers, row_of, head_of, scan_of, pieces, 128, k, scale, len(jobs))

    q = rng.standard_normal((1, HQ, D), dtype=np.float32)
    out = call(q)[0]
    equal = all(np.array_equal(out[p], partial_attention(heads[h], q[0, rows], k, scale, scan=scan)[0])
                for p, (h, rows) in enumerate(jobs))
    walls = []
    for _ in range(calls):
        q = rng.standard_normal((1, HQ, D), dtype=np.float32)
        t0 = time.perf_counter()
        call(q)
        walls.append(time.perf_counter() - t0)
    return walls, equal


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--keys", type=int, default=31680)
    ap.add_argument("--train", type=int, default=2048)
    ap.add_argument("--threads", default="8,16")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--k", type=int, default=100)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((HKV, args.keys, D), dtype=np.float32)
    values = rng.standard_normal((HKV, args.keys, D), dtype=np.float32)
    train = rng.standard_normal((HKV, args.train, D), dtype=np.float32)
    scale = D ** -0.5
    build = IndexSet(threads=len(os.sched_getaffinity(0)))
    t0 = time.perf_counter()
    build.add("seq", 0, keys, values, train)
    build_s = time.perf_counter() - t0
    heads = build._heads[("seq", 0)]
    results = {"date": time.strftime("%Y-%m-%d"), "cpu_cores": len(os.sched_getaffinity(0)),
               "commit": os.environ.get("TESSERA_COMMIT", ""), "command": "python3 " + " ".join(sys.argv),
               "keys_per_head": args.keys, "train_queries": args.train, "k": args.k, "build_seconds": build_s,
               "rows": []}
    print(f"{results['cpu_cores']} cores; 8 heads of {args.keys} keys built in {build_s:.1f} s", flush=True)
    for threads in (int(t) for t in args.threads.split(",")):
        iset = IndexSet(threads=threads)
        iset._heads[("seq", 0)] = heads
        calls = []
        read = 0
        for i in range(args.calls + 3):
            q = rng.standard_normal((1, HQ, D), dtype=np.float32)
            t0 = time.perf_counter()
            ans = iset.attend(0, ["seq"], q, args.k, scale)
            if i >= 3:
                calls.append(time.perf_counter() - t0)
                read += int(ans.scanned[0])
        jobs = pieces_of(HQ, HKV, threads)
        seq_sum, seq_max = [], []
        for _ in range(min(10, args.calls)):
            q = rng.standard_normal((1, HQ, D), dtype=np.float32)
            times = []
            for h, rows in jobs:
                t0 = time.perf_counter()
                partial_attention(heads[h], q[0, rows], args.k, scale)
                times.append(time.perf_counter() - t0)
            seq_sum.append(sum(times))
            seq_max.append(max(times))
        q = rng.standard_normal((1, HQ, D), dtype=np.float32)
        bare = bare_wall(heads, q, jobs, args.k, scale, min(threads, len(jobs)), args.calls)
        native, native_equal = native_walls(heads, jobs, args.k, scale, args.calls, rng)
        native_scan, native_scan_equal = native_walls(heads, jobs, args.k, scale, args.calls, rng, scan=True)
        iset.scan_share = 0.0                                  # every head scanned from the first call on
        scans = []
        for i in range(args.calls + 3):
            for h in range(HKV):
                iset._scans[("seq", 0, h)] = 1 << 30
            q = rng.standard_normal((1, HQ, D), dtype=np.float32)
            t0 = time.perf_counter()
            iset.attend(0, ["seq"], q, args.k, scale)
            if i >= 3:
                scans.append(time.perf_counter() - t0)
        row = {"threads": threads, "pieces": len(jobs), "attend_ms": statistics.median(calls) * 1e3,
               "keys_read_per_call": read / args.calls,
               "sequential_sum_ms": statistics.median(seq_sum) * 1e3,
               "sequential_longest_ms": statistics.median(seq_max) * 1e3,
               "bare_ms": statistics.median(bare) * 1e3, "scan_ms": statistics.median(scans) * 1e3,
               "native_ms": statistics.median(native) * 1e3, "native_equal_to_pool": native_equal,
               "native_scan_ms": statistics.median(native_scan) * 1e3, "native_scan_equal_to_pool": native_scan_equal}
        row["efficiency"] = row["sequential_sum_ms"] / (threads * row["attend_ms"])
        row["bare_efficiency"] = row["sequential_sum_ms"] / (min(threads, len(jobs)) * row["bare_ms"])
        results["rows"].append(row)
        print(f"T={threads}: {len(jobs)} pieces; attend {row['attend_ms']:.3f} ms a layer ({row['keys_read_per_call']:.0f}"
              f" keys read), one after another {row['sequential_sum_ms']:.3f} ms (longest {row['sequential_longest_ms']:.3f})"
              f", bare threads {row['bare_ms']:.3f} ms, one compiled call {row['native_ms']:.3f} ms (equal: {native_equal})"
              f", every head scanned {row['scan_ms']:.3f} ms (in one compiled call {row['native_scan_ms']:.3f}, equal: "
              f"{native_scan_equal}); efficiency {row['efficiency']:.2f} (bare "
              f"{row['bare_efficiency']:.2f})", flush=True)
        iset.close()
    build.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
