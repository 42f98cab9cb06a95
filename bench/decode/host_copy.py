"""A retrieval sequence's offloaded K/V to the host, one layer's keys at a time (GPU): ``tensor.cpu()`` of the
permuted layer and the builder's later ``np.ascontiguousarray`` (the copy before ``HostStaging``), against
``HostStaging.to_host`` (services/engine/decode/retrieval.py: one pinned buffer used again, then a host copy on its
threads into an array mapped beforehand, on one thread, and into an array mapped at first touch), with
the pinned device-to-host copy of the same bytes alone as the ceiling; the variants alternated in one process.

    python3 bench/decode/host_copy.py --tokens 129984 --rounds 5 --out bench/decode/DATE_DEVICE_COMMIT_host_copy.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.decode.sparse import commit_of  # noqa: E402
from services.engine.decode.retrieval import HostStaging  # noqa: E402


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=129984, help="offloaded tokens a layer (128K context: 129,984)")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    layer = torch.randn(args.tokens, args.kv_heads, args.head_dim, device="cuda")     # [N, Hkv, D] fp32, as rotated
    nbytes = layer.numel() * 4
    staging, alone, faulting = HostStaging(), HostStaging(threads=1), HostStaging(populate=False)
    pinned = torch.empty(layer.numel(), dtype=torch.float32, pin_memory=True)
    want = layer.permute(1, 0, 2).contiguous().cpu().numpy()
    equal = {}

    def cpu_then_contiguous():
        equal["cpu"] = np.array_equal(np.ascontiguousarray(layer.permute(1, 0, 2).cpu().numpy()), want)

    def staged():
        equal["staged"] = np.array_equal(staging.to_host(layer.permute(1, 0, 2)), want)

    def staged_one_thread():
        equal["staged_one_thread"] = np.array_equal(alone.to_host(layer.permute(1, 0, 2)), want)

    def staged_first_touch():       # the host array's pages mapped by the copy, a fault at a time (np.empty's)
        equal["staged_first_touch"] = np.array_equal(faulting.to_host(layer.permute(1, 0, 2)), want)

    variants = {"cpu_then_contiguous": cpu_then_contiguous, "staged_one_thread": staged_one_thread, "staged": staged,
                "staged_first_touch": staged_first_touch,
                "pinned_ceiling": lambda: pinned.copy_(layer.view(-1), non_blocking=True)}
    times = {name: [] for name in variants}
    for name, fn in variants.items():
        fn()                                                  # warm: the pinned buffer made, the kernels loaded
    for _ in range(args.rounds):
        for name, fn in variants.items():
            times[name].append(timed(fn))
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "commit": commit_of(),
              "host_copy_threads": staging.threads,
              "command": " ".join(sys.argv), "bytes": nbytes, "equal": equal,
              "seconds": times, "gb_s": {n: nbytes / statistics.median(t) / 1e9 for n, t in times.items()}}
    for n, t in times.items():
        print(f"{n:20s} {statistics.median(t) * 1e3:8.1f} ms  {nbytes / statistics.median(t) / 1e9:6.2f} GB/s")
    print("equal:", equal)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
