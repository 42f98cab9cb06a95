"""One thread's grouped search-and-attend (``search_attend_group_into``) on indexes out of the CPU's caches, in this
tree against another (a commit before services/index/_prefetch.py), alternated in one run.

The parent builds one index of N random normal keys (head_dim 128, M random training queries) and writes it
(``AttentionIndex.to_bytes``) with its values and queries; each round starts one child process in each tree, which
loads it, makes C copies of its arrays (so that consecutive searches read memory the last ones did not leave in
cache: pass C large enough that C copies exceed the last-level cache) and times Q searches, a group of G query heads
each, k = 100, beam 128. The children's outputs are compared: the two trees must answer alike.

    git worktree add /tmp/base 945bfd8
    python3 bench/index/prefetch.py --base /tmp/base --keys 130048 --groups 2,4 --copies 6 --rounds 5 --out F
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
D, K, BEAM, SCALE = 128, 100, 128, 0.088


def child(tree: str, data: str, groups: list[int], copies: int, result: str) -> None:
    """Time the searches in ``tree``'s code; write each group size's mean ms a search, keys read and outputs."""
    sys.path.insert(0, tree)
    from services.index import AttentionIndex, scratch
    from services.index._search_group import search_attend_group_into

    blob = np.load(data)
    idx = AttentionIndex.from_bytes(blob["index"].tobytes())
    values = blob["values"]
    gr = idx._graph
    nav, step, keys, exact_nav = idx._nav(True)
    sets = [(nav.copy(), gr.offsets.copy(), gr.targets.copy(), keys.copy(), values.copy()) for _ in range(copies)]
    out: dict[str, np.ndarray] = {}
    for g in groups:
        queries = blob[f"queries{g}"]                             # [Q, 1, g, D]
        o = np.empty((len(queries), g, D), np.float32)
        lse = np.empty((len(queries), g), np.float32)
        read = np.empty(len(queries), np.int64)
        sc = np.empty(1, np.int64)
        for warm in (True, False):                                # the first pass compiles / loads the cache
            t0 = time.perf_counter()
            for i, q in enumerate(queries):
                nv, off, tg, ks, vs = sets[i % copies]
                search_attend_group_into(nv, step, ks, off, tg, gr.entries, vs, q, BEAM, K, exact_nav, SCALE,
                                         o[i:i + 1], lse[i:i + 1], sc, *scratch.group(nav.shape[0], g, BEAM))
                read[i] = sc[0]
            ms = (time.perf_counter() - t0) / len(queries) * 1e3
        out[f"ms{g}"], out[f"out{g}"], out[f"lse{g}"], out[f"read{g}"] = np.float64(ms), o, lse, read
    np.savez(result, **out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="a tree of the code to compare against (e.g. a git worktree)")
    ap.add_argument("--keys", type=int, default=130048)
    ap.add_argument("--train", type=int, default=2048)
    ap.add_argument("--groups", default="2,4")
    ap.add_argument("--queries", type=int, default=40)
    ap.add_argument("--copies", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out")
    ap.add_argument("--child", nargs=3, metavar=("TREE", "DATA", "RESULT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    groups = [int(x) for x in args.groups.split(",")]
    if args.child:
        child(args.child[0], args.child[1], groups, args.copies, args.child[2])
        return 0
    if not args.base or not args.out:
        ap.error("--base and --out are required")
    sys.path.insert(0, str(ROOT))
    from services.index import AttentionIndex

    rng = np.random.default_rng(0)
    keys = rng.standard_normal((args.keys, D), dtype=np.float32)
    t0 = time.perf_counter()
    idx = AttentionIndex.build(keys, rng.standard_normal((args.train, D), dtype=np.float32))
    build_s = time.perf_counter() - t0
    trees = {"base": str(Path(args.base).resolve()), "this": str(ROOT)}
    times: dict[str, dict[int, list[float]]] = {t: {g: [] for g in groups} for t in trees}
    same = True
    read = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data.npz")
        np.savez(data, index=np.frombuffer(idx.to_bytes(), np.uint8),
                 values=rng.standard_normal((args.keys, D), dtype=np.float32),
                 **{f"queries{g}": rng.standard_normal((args.queries, 1, g, D), dtype=np.float32) for g in groups})
        for r in range(args.rounds):
            results = {}
            for name in (trees if r % 2 == 0 else reversed(list(trees))):
                res = os.path.join(tmp, f"{name}.npz")
                subprocess.run([sys.executable, __file__, "--groups", args.groups, "--copies", str(args.copies),
                                "--child", trees[name], data, res], check=True, cwd=trees[name])
                results[name] = dict(np.load(res))
                for g in groups:
                    times[name][g].append(float(results[name][f"ms{g}"]))
            for g in groups:
                for field in ("out", "lse", "read"):
                    same &= bool(np.array_equal(results["base"][f"{field}{g}"], results["this"][f"{field}{g}"]))
                read[g] = float(results["this"][f"read{g}"].mean())
            print(f"round {r + 1}: " + ", ".join(f"G={g} base {times['base'][g][-1]:.3f} / this "
                                                 f"{times['this'][g][-1]:.3f} ms" for g in groups), flush=True)
    rows = []
    for g in groups:
        b, t = statistics.median(times["base"][g]), statistics.median(times["this"][g])
        rows.append({"group": g, "base_ms": times["base"][g], "this_ms": times["this"][g], "base_median_ms": b,
                     "this_median_ms": t, "speedup": b / t, "keys_read_a_search": read[g]})
        print(f"G={g}: base {b:.3f} ms, this {t:.3f} ms a search ({b / t:.2f}x), {read[g]:.0f} keys read")
    print(f"outputs equal between the trees: {same}")
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu_cores": os.cpu_count(),
            "commit": os.environ.get("TESSERA_COMMIT", ""), "base": args.base, "keys": args.keys,
            "build_s": build_s, "copies": args.copies, "queries": args.queries, "outputs_equal": same,
            "command": "python3 bench/index/prefetch.py " + " ".join(sys.argv[1:]), "rows": rows}
    Path(args.out).write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
