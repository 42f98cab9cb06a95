"""Filling a fresh host array, the host half of a retrieval sequence's offload (``HostStaging.to_host``,
services/engine/decode/retrieval.py): ``np.empty`` and a copy into it, each page mapped at its first touch (a fault a
page), against ``host_array`` (an anonymous mapping made with MAP_POPULATE: mapped before the copy) and the same
copy. The variants alternate round by round, and every array is kept until the end, as the offload keeps them: an
array freed and made again would reuse mapped pages. CPU only: the pinned buffer the offload copies from is a
host array here.

    .venv/bin/python bench/decode/host_array.py --mib 256 --rounds 8 --threads 1,2 --out F
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.decode.sparse import commit_of  # noqa: E402
from services.engine.decode.retrieval import copy_pieces, host_array  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mib", type=int, default=256, help="an array's size (a 128K context's layer of keys: 508 MiB)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", default="1,2", help="threads copying into an array (HostStaging's: 8)")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",") if t]
    if args.mib < 1 or args.rounds < 1 or not threads or min(threads) < 1:
        ap.error("--mib, --rounds and every --threads entry must be at least 1")
    n = (args.mib << 20) // 4
    src = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    kept: list[np.ndarray] = []
    ways = {"np_empty": lambda: np.empty(n, np.float32), "host_array": lambda: host_array((n,), np.float32)}
    seconds: dict[str, list[float]] = {f"{w}_{t}": [] for t in threads for w in ways}
    for r in range(args.rounds):
        for t in threads:
            for w in (list(ways) if r % 2 == 0 else list(reversed(ways))):
                t0 = time.perf_counter()
                out = ways[w]()
                copy_pieces(out, src, t, piece=1 << 22)
                seconds[f"{w}_{t}"].append(time.perf_counter() - t0)
                assert out[-1] == src[-1] and out[0] == src[0]
                kept.append(out)
    gbs = {k: args.mib * (1 << 20) / statistics.median(v) / 1e9 for k, v in seconds.items()}
    for t in threads:
        print(f"{t} thread(s): np.empty {gbs[f'np_empty_{t}']:.2f} GB/s, host_array {gbs[f'host_array_{t}']:.2f} GB/s "
              f"({gbs[f'host_array_{t}'] / gbs[f'np_empty_{t}']:.2f}x; medians of {args.rounds}, {args.mib} MiB)")
    Path(args.out).write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": "cpu", "commit": commit_of(),
        "command": " ".join(sys.argv), "mib": args.mib, "rounds": args.rounds, "gb_per_s_median": gbs,
        "seconds": seconds}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
