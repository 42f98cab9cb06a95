"""The LSE merge of the short prefill's KV splits: the loop over a runtime part count against the loop unrolled
for a part count known at compile time (kernels/lse_merge/triton.py, UNROLL_PARTS), as CUDA graphs.

Shape: the engine's `tessera@0` call, 64 queries x 32 heads = 2,048 rows of d = 128, fp32 partials, bf16 out.

    python3 bench/lse_merge/merge_unroll.py [--out DIR/merge_unroll.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from kernels.lse_merge import triton as km  # noqa: E402


def graph_us(fn, reps=200) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(32):
            fn()
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps // 32 + 1):
            g.replay()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / ((reps // 32 + 1) * 32))
    return best * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for parts in (4, 6, 8, 12):
        outs = torch.randn(parts, 2048, 128, device="cuda")
        lses = torch.randn(parts, 2048, device="cuda") * 4
        res = {}
        for name, unroll in (("loop", 0), ("unrolled", 16)):
            km.UNROLL_PARTS = unroll
            res[name] = km.merge_rows(outs, lses, torch.bfloat16)
            rows.append({"parts": parts, "variant": name,
                         "us": graph_us(lambda: km.merge_rows(outs, lses, torch.bfloat16))})
        same = all(torch.equal(a, b) for a, b in zip(res["loop"], res["unrolled"]))
        print(f"{parts:2d} parts: loop {rows[-2]['us']:.2f} us, unrolled {rows[-1]['us']:.2f} us, same bits {same}",
              flush=True)
        rows[-1]["same_bits"] = rows[-2]["same_bits"] = same
    km.UNROLL_PARTS = 16
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows,
                                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
