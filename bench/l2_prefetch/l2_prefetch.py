"""Can the GPU stream the next projection's weights into L2 while attention runs? (issue #2's ratio-0 pass)

In a ``tessera@0`` layer, HBM idles while the short attention call runs (~30-40 us, 12.8 MB of K/V) and
the o_proj GEMM that follows reads 33.5 MB of weights at ~2.2 TB/s. This probe measures, on CUDA graphs
of 32 layers' worth of distinct weights (the 50 MB L2 holds none of them between layers):
  cold      the o GEMM (64 rows x 4096 x 4096, bf16) on weights not in L2;
  warm      the same GEMM right after the same weight was read (what an L2-resident weight costs);
  busy      a stand-in for attention (a compute-bound 2048^3 matmul on small L2-resident operands), then
            the o GEMM, per layer;
  busy+pf   the same with an L2 prefetch of the o weight on a parallel graph branch forked before the
            stand-in and joined before the GEMM (PTX cp.async.bulk.prefetch.L2 or prefetch.global.L2).

    python3 bench/l2_prefetch/l2_prefetch.py [--out DIR/l2_prefetch.json]

Outcome (H100, 2026-11-22, bench/l2_prefetch/2026-11-22_h100_fb9a504.json): an L2-resident o weight makes the GEMM 9.1 us instead of
14.6, but the prefetch branch does not overlap the stand-in (every SM is busy with it): busy then GEMM 41.6 us
a layer, with the prefetch 45.3 (half the weight) / 51.3 us (all of it). Not adopted.

Second attempt (H100, 2026-11-22 18:20 UTC, ``bench/l2_prefetch/2026-11-22_h100_f2f9ca8_attention.json``): the short prefill attention
kernel itself asked L2 for the o weight (each program an aligned share, one ``cp.async.bulk.prefetch.L2`` per
4 KB, before its own work), 32 layers of the real short attention (64 queries over 6 x 512 cached keys) then the
o GEMM, as CUDA graphs, outputs checked equal: 48.1 us a layer without, 50.1 with the whole weight, 50.0 with half
of it (the attention alone 29.0 -> 31.8 us, the GEMM alone 15.0); the engine's ``tessera@0`` 7.7 -> 8.0 ms
(``bench/engine/2026-11-22_h100_f2f9ca8_lean_l2.json``). Removed again (the code is commit 5cf5024 and its follow-ups, reverted).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

CHUNK, LANES, LINE = 4096, 128, 128  # bytes a bulk prefetch asks for, prefetches a program issues at once, L2 line
_BULK = tl.constexpr("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $2, 0;\n\t@p cp.async.bulk.prefetch.L2.global [$1], $3;"
                     "\n\tmov.u32 $0, 0;\n\t}")
_LINE = tl.constexpr("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $2, 0;\n\t@p prefetch.global.L2 [$1];\n\t"
                     "mov.u32 $0, 0;\n\t}")


@triton.jit
def _prefetch_kernel(ptr, n_bytes, STEP: tl.constexpr, LANES: tl.constexpr, BULK: tl.constexpr):
    """Ask L2 for bytes [0, n_bytes) of ptr: STEP bytes a lane (one bulk prefetch, or one line)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    lanes = tl.arange(0, LANES)
    for base in range(pid * LANES * STEP, n_bytes, nprog * LANES * STEP):
        off = base + lanes * STEP
        ok = off < n_bytes
        if BULK:
            size = tl.minimum(n_bytes - off, STEP).to(tl.int32)
            tl.inline_asm_elementwise(_BULK, "=r,l,r,r", [ptr + off, ok.to(tl.int32), size], dtype=tl.int32,
                                      is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(_LINE, "=r,l,r", [ptr + off, ok.to(tl.int32)], dtype=tl.int32,
                                      is_pure=False, pack=1)


def l2_prefetch(t: torch.Tensor, fraction: float = 1.0, mode: str = "bulk", programs: int = 16) -> None:
    """A hint (no value changes): the first ``fraction`` of contiguous t's bytes into L2."""
    n_bytes = int(t.numel() * t.element_size() * fraction) // 128 * 128
    step = CHUNK if mode == "bulk" else LINE
    grid = (max(1, min(programs, triton.cdiv(n_bytes, LANES * step))),)
    _prefetch_kernel[grid](t.view(-1).view(torch.uint8), n_bytes, STEP=step, LANES=LANES, BULK=mode == "bulk")


def graph_ms(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    dev = torch.device("cuda")
    n = args.layers
    x = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16)
    ws = [torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(n)]
    a = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    rows = {}

    def cold():
        for w in ws:
            F.linear(x, w)

    def warm():
        for w in ws:
            F.linear(x, w)
            F.linear(x, w)

    def busy():
        for w in ws:
            a @ a
            F.linear(x, w)

    def busy_only():
        for _ in ws:
            a @ a

    def busy_pf(mode, fraction=1.0):
        def body():
            for w in ws:
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    l2_prefetch(w, fraction=fraction, mode=mode)
                a @ a
                main.wait_stream(side)
                F.linear(x, w)
        return body

    t_cold, t_warm = graph_ms(cold), graph_ms(warm)
    rows["cold_us"] = t_cold / n * 1e3
    rows["warm_us"] = (t_warm - t_cold) / n * 1e3
    rows["busy_only_us"] = graph_ms(busy_only) / n * 1e3
    rows["busy_then_gemm_us"] = graph_ms(busy) / n * 1e3
    for mode in ("bulk", "lines"):
        for frac in (0.5, 1.0):
            try:
                rows[f"busy_pf_{mode}_{frac}_us"] = graph_ms(busy_pf(mode, frac)) / n * 1e3
            except Exception as exc:  # report and go on
                rows[f"busy_pf_{mode}_{frac}_error"] = repr(exc)[:300]
    for k, v in rows.items():
        print(f"{k:28s} {v:.2f}" if isinstance(v, float) else f"{k:28s} {v}", flush=True)
    if args.out:
        rec = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "layers": n, "us_per_layer": rows}
        Path(args.out).write_text(json.dumps(rec, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
