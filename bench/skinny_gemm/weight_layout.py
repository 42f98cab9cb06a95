"""Does the weights' layout in HBM cap the skinny GEMM's bandwidth? (issue #2's `tessera@0` pass)

At 64 rows the projections stream their weights at 2.3-2.8 TB/s, a plain ``x.sum()`` at 3.08 TB/s. A
[BLOCK_N, BLOCK_K] tile of a row-major [N, K] weight is BLOCK_N runs of BLOCK_K * 2 bytes, K * 2 bytes apart,
so the DRAM sees short runs from many rows at once; the same tile stored contiguously (the weight pre-tiled
at load time, [N / BLOCK_N, K / BLOCK_K, BLOCK_N, BLOCK_K]) is one run. This probe times the same Triton
kernel (x [64, K] @ tile.T per step, the skinny GEMM's inner loop) over both layouts, for gate|up's and
down's shapes, 32 distinct weights in one CUDA graph (no L2 reuse), beside ``x.sum()`` over as many bytes.
The outputs of both layouts are checked equal.

    python3 bench/skinny_gemm/weight_layout.py [--out DIR/weight_layout.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _stream(x_ptr, w_ptr, out_ptr, N, K, TILED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    n_k = K // BLOCK_K
    for kk in tl.range(0, n_k, num_stages=STAGES):
        x = tl.load(x_ptr + rm[:, None] * K + kk * BLOCK_K + rk[None, :])
        if TILED:  # tile (pid, kk) is BLOCK_N * BLOCK_K contiguous elements
            base = (pid * n_k + kk).to(tl.int64) * (BLOCK_N * BLOCK_K)
            w = tl.load(w_ptr + base + rn[:, None] * BLOCK_K + rk[None, :])
        else:
            w = tl.load(w_ptr + (pid * BLOCK_N + rn[:, None]).to(tl.int64) * K + kk * BLOCK_K + rk[None, :])
        acc = tl.dot(x, tl.trans(w), acc)
    tl.store(out_ptr + rm[:, None] * N + pid * BLOCK_N + rn[None, :], acc.to(out_ptr.dtype.element_ty))


def tiled(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    n, k = w.shape
    return w.view(n // bn, bn, k // bk, bk).permute(0, 2, 1, 3).contiguous()


def graph_us(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--copies", type=int, default=32)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for name, n, k in (("gate_up", 28672, 4096), ("down", 4096, 14336), ("o", 4096, 4096)):
        x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(args.copies)]
        gb = n * k * 2 * args.copies / 1e9
        flat = torch.cat([w.view(-1) for w in ws[:4]])
        sum_us = graph_us(lambda: [flat.sum() for _ in range(args.copies // 4)]) / args.copies
        row = {"shape": name, "N": n, "K": k, "x.sum us per weight": sum_us,
               "x.sum TB/s": n * k * 2 / sum_us / 1e6, "configs": []}
        for bn, bk, stages in ((64, 128, 3), (64, 128, 4), (32, 128, 6), (32, 256, 4), (128, 64, 4)):
            if n % bn or k % bk:
                continue
            wt = [tiled(w, bn, bk) for w in ws]
            out_a = torch.empty(64, n, device="cuda", dtype=torch.bfloat16)
            out_b = torch.empty_like(out_a)
            grid = (n // bn,)
            kw = dict(BLOCK_M=64, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, num_warps=4)
            _stream[grid](x, ws[0], out_a, n, k, TILED=False, **kw)
            _stream[grid](x, wt[0], out_b, n, k, TILED=True, **kw)
            same = bool(torch.equal(out_a, out_b))
            us_row = graph_us(lambda: [_stream[grid](x, w, out_a, n, k, TILED=False, **kw) for w in ws]) / len(ws)
            us_tile = graph_us(lambda: [_stream[grid](x, w, out_b, n, k, TILED=True, **kw) for w in wt]) / len(wt)
            cfg = {"block_n": bn, "block_k": bk, "stages": stages, "same_bits": same,
                   "row_major_us": us_row, "row_major_TBs": n * k * 2 / us_row / 1e6,
                   "tiled_us": us_tile, "tiled_TBs": n * k * 2 / us_tile / 1e6}
            row["configs"].append(cfg)
            print(f"{name:8s} n{bn} k{bk} st{stages}: row-major {us_row:6.1f} us ({cfg['row_major_TBs']:.2f} TB/s), "
                  f"tiled {us_tile:6.1f} us ({cfg['tiled_TBs']:.2f} TB/s), same bits {same}; x.sum "
                  f"{row['x.sum TB/s']:.2f} TB/s", flush=True)
            del wt
        rows.append(row)
        del ws, flat
        torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gb_per_shape": gb, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
