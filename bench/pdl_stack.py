"""Programmatic dependent launch for the skinny GEMMs: does a layer stack get faster? (issue #2's ratio-0 pass)

A short pass is a chain of kernels, each reading its weights once; between two of them the GPU drains
(the last programs of one kernel finish while SMs idle) and refills. With a programmatic dependent launch
(PDL) a kernel's programs start while the kernel before it finishes: they ask L2 for their first weight
rows, wait for it (griddepcontrol.wait), then run. This times, as one CUDA graph over 32 layers of distinct
Llama-3-8B weights (bf16), the projection chain h -> q|k|v -> o -> gate|up with SiLU*up -> down (+= h),
every launch through kernels/linear's Triton kernel, without PDL and with it (0, 2 or 4 prefetched steps),
and checks that every variant gives the same bits.

    python3 bench/pdl_stack.py [--out DIR/pdl_stack.json] [--rows 64,8]

Outcome (H100, 2026-11-22, bench/pdl_stack.json): 64 rows 5.298 ms without PDL, 5.210 / 5.131 / 5.147 ms with it
(0 / 2 / 4 steps prefetched); 8 rows 5.082 ms without, 5.090 / 5.205 / 5.652 with. In the engine, where the kernels
before most projections (norms, attention, cuBLAS) do not take part, no change beyond the spread (bench/engine.md,
round 6). Kept off (kernels/linear/triton.py, PDL_PREFETCH_STEPS = -1).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

from kernels.linear import triton as kt  # noqa: E402
from kernels.linear.config import LinearConfig  # noqa: E402

HIDDEN, QKV, INTER = 4096, 6144, 14336


def configs(m: int) -> dict[str, LinearConfig]:
    """The sweep's fastest Triton configs per projection at m rows (bench/skinny_gemm.md)."""
    if m <= 8:
        return {"qkv": LinearConfig(16, 64, 256, num_stages=3), "o": LinearConfig(16, 32, 128, num_stages=5),
                "down": LinearConfig(16, 32, 256, num_stages=5)}
    return {"qkv": LinearConfig(64, 64, 128, num_stages=5), "o": LinearConfig(64, 32, 128, num_stages=5),
            "down": LinearConfig(64, 32, 256, num_stages=4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rows", default="64,8")
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)

    def weight(n, k):
        return torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * k ** -0.5

    layers = [(weight(QKV, HIDDEN), weight(HIDDEN, HIDDEN), weight(2 * INTER, HIDDEN), weight(HIDDEN, INTER))
              for _ in range(args.layers)]
    weight_bytes = sum(w.numel() * 2 for ws in layers for w in ws)
    rec = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "layers": args.layers, "rows": {}}
    for m in (int(r) for r in args.rows.split(",")):
        cfg = configs(m)
        x0 = torch.randn(m, HIDDEN, device=dev, dtype=torch.bfloat16, generator=g)
        outs = {}

        def stack(pdl):
            def body():
                h = x0
                for wqkv, wo, wgu, wd in layers:
                    qkv = kt.linear(h, wqkv, config=cfg["qkv"], pdl=pdl)
                    h2 = kt.linear(qkv[:, :HIDDEN], wo, config=cfg["o"], pdl=pdl)
                    act = kt.linear_swiglu(h2, wgu, pdl=pdl)
                    h = kt.linear(act, wd, accumulate=h2, config=cfg["down"], pdl=pdl)
                return h
            return body

        row = {}
        for pdl in (-1, 0, 2, 4):
            name = "off" if pdl < 0 else f"pdl+{pdl}"
            try:
                ms = triton.testing.do_bench_cudagraph(stack(pdl), rep=200, return_mode="median")
            except Exception as exc:  # report and go on
                row[name] = {"error": repr(exc)[:400]}
                print(f"M={m} {name}: {exc!r}"[:400], flush=True)
                continue
            outs[pdl] = stack(pdl)().clone()  # one eager run (a graph's output lives in its pool, reused by the next)
            torch.cuda.synchronize()
            same = bool(torch.equal(outs[pdl], outs[-1])) if -1 in outs else None
            row[name] = {"ms": ms, "tb_s": weight_bytes / ms / 1e9, "same_bits_as_off": same}
            print(f"M={m:3d} {name:7s} {ms:7.3f} ms  {weight_bytes / ms / 1e9:5.2f} TB/s  same bits: {same}", flush=True)
        rec["rows"][str(m)] = row
    if args.out:
        Path(args.out).write_text(json.dumps(rec, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
