"""The int8 codes of one KV head's keys (services/index/compact.py ``quantize``): the compiled pass against its plain
numpy twin (float64 throughout, what the pass must equal bit for bit), alternated in one process.

    .venv/bin/python bench/index/quantize.py [--keys 130048] [--dim 128] [--rounds 5] [--out F]
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

from services.index.compact import quantize, quantize_twin as twin  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=130048)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    keys = np.random.default_rng(0).standard_normal((args.keys, args.dim)).astype(np.float32)
    quantize(keys[:8])                                  # compiled (or loaded from numba's cache) before timing
    times = {"numpy": [], "compiled": []}
    for r in range(args.rounds):
        order = (("numpy", twin), ("compiled", quantize))
        for name, f in order if r % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            f(keys)
            times[name].append(time.perf_counter() - t0)
    got, want = quantize(keys), twin(keys)
    equal = bool(np.array_equal(got.codes, want[0]) and np.array_equal(got.step, want[1]))
    out = {"keys": args.keys, "dim": args.dim, "rounds": args.rounds, "seconds": times, "equal": equal,
           "median_s": {k: statistics.median(v) for k, v in times.items()}}
    print(json.dumps(out["median_s"]), "codes equal:", equal)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
