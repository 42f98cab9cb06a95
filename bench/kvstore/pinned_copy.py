"""What offloading a computed chunk to the host costs the thread that asks (``staging.copy_aside`` to the CPU, as a
prefill worker's host tier and store puts take each chunk it computes): its 2 x L layer tensors copied off the GPU
into pinned memory on a side stream, one pinned allocation a tensor (as before) against one a chunk
(``staging.pinned_like``), while a host tier keeps the last ``--keep`` chunks alive so that the pinned allocator churns
as in a serving run. Per chunk: the caller's time (what the engine thread loses) and the time until the copies are done.

    python3 bench/kvstore/pinned_copy.py --chunks 200 --keep 48 --json bench/kvstore/DATE_DEVICE_COMMIT_pinned_copy.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def per_tensor(tensors, device):
    """The allocation before: ``copy_aside`` with a pinned tensor each (``staging.pinned_like`` swapped for the call)."""
    import torch

    from services.cluster import staging

    each = staging.pinned_like
    staging.pinned_like = lambda ts, pin=True: [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in ts]
    try:
        return staging.copy_aside(tensors, device)
    finally:
        staging.pinned_like = each


def run(way, fn, layers, args) -> dict:
    import torch

    kept = collections.deque(maxlen=args.keep)
    call, done = [], []
    for i in range(args.chunks + args.warmup):
        t0 = time.perf_counter()
        out, ready = fn(layers, torch.device("cpu"))
        t1 = time.perf_counter()
        ready.synchronize()
        t2 = time.perf_counter()
        kept.append(out)
        if i >= args.warmup:
            call.append((t1 - t0) * 1e3)
            done.append((t2 - t0) * 1e3)
    return {"way": way, "call_ms_median": statistics.median(call), "call_ms_p90": sorted(call)[int(0.9 * len(call))],
            "done_ms_median": statistics.median(done)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--keep", type=int, default=48, help="chunks the host tier keeps alive (64 MiB each at 8B)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2, help="each way this many times, interleaved")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import torch

    from services.cluster.staging import copy_aside

    g = torch.Generator(device="cuda").manual_seed(0)
    layers = [torch.randn(args.tokens, 8, 128, device="cuda", generator=g).to(torch.bfloat16)
              for _ in range(2 * args.layers)]
    ref, ready = copy_aside(layers, torch.device("cpu"))
    ready.synchronize()
    assert all(torch.equal(a, b.cpu()) for a, b in zip(ref, layers)), "copy_aside's host copies differ"
    rows = []
    for _ in range(args.repeats):
        for way, fn in (("a pinned tensor each", per_tensor), ("one pinned allocation a chunk", copy_aside)):
            rows.append(run(way, fn, layers, args))
            print(json.dumps(rows[-1]), flush=True)
    res = {"what": "copy_aside to the CPU of one chunk's layers, pinned memory a tensor against a chunk",
           "command": "python3 bench/kvstore/pinned_copy.py " + " ".join(sys.argv[1:]),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "commit": os.environ.get("TESSERA_COMMIT", ""), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "chunk_mib": 2 * args.layers * args.tokens * 8 * 128 * 2 / 2**20, "args": vars(args) | {"json": str(args.json)},
           "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
