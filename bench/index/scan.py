"""A whole scan against a graph search (services/index/_scan.py), on one core: time a query group and recall@k.

Two kinds of keys: random normal ones (as the decode benchmarks' random weights make: nothing for a graph to use),
and the trained longgen model's post-RoPE Q/K (``loadgen/quality/qk_dump.py``, every (layer, KV head), its held-out
answer-position queries searched as groups). Per case: ms a group (median over the groups), keys read a group,
recall@k against the exact top-k (tie-aware), for the graph (``attend_group``) and the scan (``attend_group(scan=True)``); and
whether ``IndexSet`` would scan that head (its graph search read at least ``heads.SCAN_SHARE`` of the keys).

    python3 bench/index/scan.py --random 8192,31680 --prompts 16 --out bench/index/DATE_DEVICE_COMMIT_scan.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadgen.quality.qk_dump import dump_qk          # noqa: E402
from services.index import AttentionIndex            # noqa: E402
from services.index._scan import TILE, scan_group   # noqa: E402
from services.index._search import rescore            # noqa: E402
from services.index.graph import DEFAULT_BEAM         # noqa: E402
from services.index.heads import SCAN_SHARE          # noqa: E402


def recall(keys, query, ids, k):
    """Tie-aware recall@k of ``ids`` [k] for one query."""
    exact = np.sort(keys @ query)[::-1]
    kth = exact[k - 1]
    got = keys[ids[ids >= 0]] @ query
    return float(min(k, int((got >= kth - 1e-4 * abs(kth)).sum())) / k)


def scan_ids(index, group, k, beam=DEFAULT_BEAM):
    """The ids a scan attends for each head of ``group`` [g, D]: its beam by code score, rescored exactly, the top k
    (what ``scan_attend_group`` does before attending)."""
    g = group.shape[0]
    ids, scores = np.empty((g, beam), np.int64), np.empty((g, beam), np.float32)
    sizes, tile = np.zeros(g, np.int64), np.empty((g, TILE), np.float32)
    scan_group(index.compact.codes, index.compact.step, group, beam, ids, scores, sizes, tile)
    for h in range(g):
        rescore(index.keys, group[h], ids[h], scores[h], sizes[h])
    return ids[:, :k]


def case(index, keys, values, groups, k, reps):
    """groups [B, G, D]: per path, ms a group (median), keys read a group (mean), recall@k (mean over heads)."""
    out = {}
    for name, scan in (("graph", False), ("scan", True)):
        index.attend_group(groups[:1], values, k, 0.1, scan=scan)                 # compiled
        times, reads, recalls = [], [], []
        for _ in range(reps):
            for b in range(groups.shape[0]):
                t0 = time.perf_counter()
                _, _, scanned = index.attend_group(groups[b:b + 1], values, k, 0.1, scan=scan)
                times.append(time.perf_counter() - t0)
                reads.append(int(scanned[0]))
        for b in range(groups.shape[0]):
            ids = index.search_group(groups[b:b + 1], k)[0][0] if name == "graph" else scan_ids(index, groups[b], k)
            recalls += [recall(keys, q, ids[h], k) for h, q in enumerate(groups[b])]
        out[name] = {"ms": statistics.median(times) * 1e3, "keys_read": statistics.mean(reads),
                     "recall": statistics.mean(recalls)}
    out["graph_share"] = out["graph"]["keys_read"] / keys.shape[0]
    out["would_scan"] = out["graph_share"] >= SCAN_SHARE
    out["scan_vs_graph"] = out["graph"]["ms"] / out["scan"]["ms"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--random", default="8192,31680", help="numbers of random normal keys (dim 128, 4 heads a group)")
    ap.add_argument("--prompts", type=int, default=16, help="longgen prompts pooled into each head's keys (0: none)")
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    res = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "k": args.k, "scan_share": SCAN_SHARE, "threads": 1,
           "random": [], "longgen": []}
    rng = np.random.default_rng(0)
    for n in (int(x) for x in args.random.split(",") if x):
        keys = rng.standard_normal((n, 128)).astype(np.float32)
        values = rng.standard_normal((n, 128)).astype(np.float32)
        index = AttentionIndex.build(keys, rng.standard_normal((2048, 128)).astype(np.float32))
        groups = rng.standard_normal((args.groups, 4, 128)).astype(np.float32)
        row = {"keys": n, **case(index, keys, values, groups, args.k, args.reps)}
        res["random"].append(row)
        print(f"random {n}: graph {row['graph']['ms']:.3f} ms ({row['graph_share']:.1%} read, recall "
              f"{row['graph']['recall']:.3f}), scan {row['scan']['ms']:.3f} ms (recall {row['scan']['recall']:.3f}): "
              f"{row['scan_vs_graph']:.2f}x", flush=True)
    if args.prompts:
        for head in dump_qk("longgen", prompts=args.prompts, spread=True):
            group = head.queries.shape[0] // head.keys.shape[0]
            held = head.heldout.reshape(group, -1, head.keys.shape[1]).transpose(1, 0, 2)[:args.groups].copy()
            values = rng.standard_normal(head.keys.shape).astype(np.float32)
            index = AttentionIndex.build(head.keys, head.queries)
            row = {"layer": head.layer, "kv_head": head.kv_head, "keys": head.keys.shape[0],
                   **case(index, head.keys, values, held, min(args.k, head.keys.shape[0] - 1), args.reps)}
            res["longgen"].append(row)
            print(f"longgen L{head.layer} H{head.kv_head} ({row['keys']} keys): graph {row['graph']['ms']:.3f} ms "
                  f"({row['graph_share']:.1%} read, recall {row['graph']['recall']:.3f}), scan {row['scan']['ms']:.3f} "
                  f"ms: {row['scan_vs_graph']:.2f}x; would scan: {row['would_scan']}", flush=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
