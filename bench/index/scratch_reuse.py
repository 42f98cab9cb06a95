"""A decode layer's searches with each call allocating its scratch against each thread reusing its own
(services/index/scratch.py), on all of the host's threads at once, alternated in one run.

8 KV heads of N random normal keys (8B-shaped: head_dim 128), each head's index built from M random training queries;
a layer's call is 16 searches (each head's 4 query heads cut into 2 pieces of 2, as IndexSet.attend cuts them for
16 threads at batch 1), each on its own thread, released together by a barrier; its wall is the slowest one's.

    python3 bench/index/scratch_reuse.py --keys 31680,130048 --calls 60 --rounds 3 --out F
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.index import AttentionIndex, scratch  # noqa: E402
from services.index._search_group import search_attend_group, search_attend_group_into  # noqa: E402

HKV, PIECES, G, D, K, BEAM = 8, 2, 2, 128, 100, 128


def layer_walls(indexes, values, queries, reuse: bool, calls: int) -> list[float]:
    """``calls`` layer calls' walls (s): 16 threads, each searching its (head, piece) once a call."""
    tasks = [(h, p) for h in range(HKV) for p in range(PIECES)]
    start, done = threading.Barrier(len(tasks) + 1), threading.Barrier(len(tasks) + 1)

    def worker(h: int, p: int) -> None:
        idx = indexes[h]
        gr = idx._graph
        nav, step, keys, exact_nav = idx._nav(True)
        out = np.empty((1, G, D), np.float32)
        lse = np.empty((1, G), np.float32)
        scanned = np.empty(1, np.int64)
        for c in range(calls + 1):
            q = np.ascontiguousarray(queries[c % len(queries), h, p][None])
            start.wait()
            if reuse:
                search_attend_group_into(nav, step, keys, gr.offsets, gr.targets, gr.entries, values[h], q, BEAM, K,
                                         exact_nav, 0.088, out, lse, scanned, *scratch.group(nav.shape[0], G, BEAM))
            else:
                search_attend_group(nav, step, keys, gr.offsets, gr.targets, gr.entries, values[h], q, BEAM, K,
                                    exact_nav, 0.088, out, lse, scanned)
            done.wait()

    threads = [threading.Thread(target=worker, args=t) for t in tasks]
    for t in threads:
        t.start()
    walls = []
    for c in range(calls + 1):
        t0 = time.perf_counter()
        start.wait()
        done.wait()
        if c:                       # the first call of each thread warms its code and (reused) allocates
            walls.append(time.perf_counter() - t0)
    for t in threads:
        t.join()
    return walls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", default="31680,130048")
    ap.add_argument("--train", type=int, default=2048)
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for n in (int(x) for x in args.keys.split(",")):
        keys = [rng.standard_normal((n, D), dtype=np.float32) for _ in range(HKV)]
        train = [rng.standard_normal((args.train, D), dtype=np.float32) for _ in range(HKV)]
        values = [rng.standard_normal((n, D), dtype=np.float32) for _ in range(HKV)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(HKV) as pool:
            indexes = list(pool.map(lambda h: AttentionIndex.build(keys[h], train[h]), range(HKV)))
        build_s = time.perf_counter() - t0
        queries = rng.standard_normal((64, HKV, PIECES, G, D), dtype=np.float32)
        res: dict[str, list[float]] = {"fresh": [], "reused": []}
        for _ in range(args.rounds):
            for name in ("fresh", "reused"):
                res[name].append(statistics.median(layer_walls(indexes, values, queries, name == "reused",
                                                               args.calls)) * 1e3)
        row = {"keys": n, "build_s": build_s, "fresh_ms": res["fresh"], "reused_ms": res["reused"],
               "fresh_median_ms": statistics.median(res["fresh"]), "reused_median_ms": statistics.median(res["reused"])}
        rows.append(row)
        print(f"N {n}: a layer's 16 searches, wall median by round: fresh {[round(x, 3) for x in res['fresh']]} ms, "
              f"reused {[round(x, 3) for x in res['reused']]} ms (builds {build_s:.1f} s)", flush=True)
    meta = {"cpu_cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": os.environ.get("TESSERA_COMMIT", ""), "calls": args.calls, "rounds": args.rounds,
            "command": "python3 bench/index/scratch_reuse.py " + " ".join(sys.argv[1:]), "rows": rows}
    Path(args.out).write_text(json.dumps(meta, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
