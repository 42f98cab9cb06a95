"""Skinny GEMM sweep (issue #2's ratio-0 pass): kernels/linear's Triton kernel against cuBLAS at few rows.

Llama-3-8B's projections (q|k|v, o, gate|up, down accumulating onto the residual, lm_head), bf16, at M in
{1, 8, 32, 64, 128}. Each shape has 32 distinct weights (the 32 layers: the H100's 50 MB L2 cannot keep a
weight between repeats; lm_head 4, each 1 GB); one CUDA graph runs the 32 GEMMs in sequence
(``do_bench_cudagraph``, median). Reported: us per GEMM and TB/s of weight read, cuBLAS (F.linear /
addmm_) beside every config of the sweep grid, each config first checked against the twin on the GPU.
Then a read-bandwidth ceiling and a whole layer stack (32 x q|k|v, o, gate|up, down) with the best
configs against cuBLAS at M = 64 and 8. Prints the best configs as kernels/linear/config.py's CONFIGS.

    python3 bench/skinny_gemm/skinny_gemm.py --out DIR/skinny_gemm.json [--quick] [--jobs 16]
    python3 bench/skinny_gemm/skinny_gemm.py --compile-only [--quick]      # no GPU: every variant compiled for sm_90
                                                               # (tests/kernels/compile_linear_sm90.py)
    TRITON_INTERPRET=1 python3 bench/skinny_gemm/skinny_gemm.py --smoke    # no GPU: the whole flow on tiny shapes

    python3 bench/skinny_gemm/skinny_gemm.py --tma-ab --out DIR/skinny_tma_ab.json
    python3 bench/skinny_gemm/skinny_gemm.py --tma-ab --compile-only          # no GPU: every A/B kernel for sm_90
    TRITON_INTERPRET=1 python3 bench/skinny_gemm/skinny_gemm.py --tma-ab --smoke

``--tma-ab``: the TMA weight stream (kernels/linear/tma.py) against the pointer kernel's configs of today and
cuBLAS, for a 64-row layer's launches (q|k|v, o, gate|up SwiGLU, down onto the residual) and lm_head at 1 row:
every TMA config of a small grid (``tma_grid``) checked against the twin on the GPU, then timed over the 32
distinct weights as one CUDA graph; the three fastest re-timed longer beside cuBLAS, the pointer config and the
pointer kernel at the same tiles; then 32 layers of the four launches, pointer configs against the best TMA
ones (each also as programmatic dependent launches). Prints the best TMA config per launch as config.py's
CONFIGS entries.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "kernels")]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.linear import LinearConfig, reference  # noqa: E402

# name -> (N, K, accumulate onto the residual, distinct weights)
SHAPES = {"qkv": (6144, 4096, False, 32), "o": (4096, 4096, False, 32), "gate_up": (28672, 4096, False, 32),
          "down": (4096, 14336, True, 32), "lm_head": (128256, 4096, False, 4)}
SMOKE_SHAPES = {"qkv": (96, 128, False, 2), "o": (128, 128, False, 2), "gate_up": (192, 128, False, 2),
                "down": (128, 96, True, 2)}  # a tiny layer: the whole flow, layer stack included
MS = (1, 8, 32, 64, 128)
SMS = 132
SMEM_LIMIT = 220 * 1024
MIN_IN_FLIGHT = 32 * 1024
TOL = 1e-2  # max |error| over max |twin|: bf16 rounding of the same fp32 sums is ~4e-3
# --tma-ab's SwiGLU launches: gate, up, silu and the product each rounded (a 1-ulp change in one moves the result a
# few ulps); under the interpreter (smoke) every fp32 -> bf16 cast truncates
TOL_AB = 2e-2 if os.environ.get("TRITON_INTERPRET") != "1" else 6e-2


def block_ms(m: int) -> list[int]:
    return [16] if m <= 16 else [32] if m <= 32 else [64] if m <= 64 else [64, 128]


def grid(m: int, n: int, k: int, quick: bool) -> list[LinearConfig]:
    """The sweep for one (M, N, K), pruned to launches that can win: tiles in shared memory, >= 2 K steps
    a split (and no more stages than steps), enough programs for half the SMs, no split once the
    unsplit grid already fills 4 waves, 8 warps only for tiles of >= 64 x 64 rows and columns, at most 64
    fp32 accumulators a thread (128 x 128 on 4 warps spills on Triton 3.6), and at least
    MIN_IN_FLIGHT bytes of weight loads in flight per program (latency hiding of a streamed read)."""
    bns, bks = ((64, 128), (128, 256)) if quick else ((32, 64, 128), (64, 128, 256))
    warps, stages = ((4,), (3, 4)) if quick else ((4, 8), (3, 4, 5))
    out = []
    for bm in block_ms(m):
        for bn in bns:
            tiles = -(-m // bm) * -(-n // bn)
            for bk in bks:
                for s in (1, 2, 4, 8):
                    steps = k // (bk * s)
                    if s > 1 and (steps < 2 or tiles * s // 2 >= 4 * SMS):
                        continue
                    if tiles * s < SMS // 2:
                        continue
                    for w in warps:
                        if w == 8 and (bm < 64 or bn < 64) or bm * bn > 64 * 32 * w:
                            continue  # 8 warps for small tiles idle; > 64 fp32 accumulators a thread spill
                        for st in stages:
                            cfg = LinearConfig(bm, bn, bk, split_k=s, num_warps=w, num_stages=st)
                            if st > steps + 1 or (st - 1) * (bm + bn) * bk * 2 > SMEM_LIMIT:
                                continue
                            if (st - 1) * bn * bk * 2 < MIN_IN_FLIGHT:  # too few weight bytes in flight
                                continue
                            out.append(cfg)
    return out


def smoke_grid(m: int, n: int, k: int, quick: bool) -> list[LinearConfig]:
    return [LinearConfig(16, 32, 32, num_stages=2), LinearConfig(16, 32, 64, split_k=2, num_stages=2),
            LinearConfig(16, 32, 32, split_k=4, num_stages=2)]


def time_ms(fn, rep: int) -> float:
    """Median ms of fn: replayed as a CUDA graph on CUDA; on the CPU (smoke) wall time of 3 calls."""
    if torch.cuda.is_available():
        import triton

        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_one(cfg: LinearConfig | None, x, w, acc) -> torch.Tensor:
    """One GEMM's output (cfg None: cuBLAS), accumulating onto a copy of acc."""
    from kernels.linear import linear

    if acc is not None:
        c = acc.clone()
        got = c.addmm_(x, w.t()) if cfg is None else linear(x, w, accumulate=c, backend="triton", config=cfg)
    else:
        got = F.linear(x, w) if cfg is None else linear(x, w, backend="triton", config=cfg)
    return got


def check(cfg: LinearConfig | None, x, w, acc, want) -> float:
    """Max |kernel - twin| / max |twin| of one GEMM (cfg None: cuBLAS)."""
    got = run_one(cfg, x, w, acc)
    return float((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def gemms(cfg: LinearConfig | None, x, ws, acc):
    """The callable timed: one GEMM per distinct weight (cfg None: cuBLAS as the model calls it)."""
    from kernels.linear import linear

    if cfg is None:
        return (lambda: [acc.addmm_(x, w.t()) for w in ws]) if acc is not None else (
            lambda: [F.linear(x, w) for w in ws])
    return lambda: [linear(x, w, accumulate=acc, backend="triton", config=cfg) for w in ws]


def precompile(tasks: list[tuple], jobs: int, warm=None) -> tuple[int, list[str]]:
    """Compile every (m, n, k, cfg, accumulate) on ``jobs`` spawned processes (Triton's disk cache is
    shared, so the timing process then only loads them); (compiled, errors). Best effort: a failure here
    is reported, and the config is tried (and caught) again when timed. ``warm``: the task's compile
    (default ``_warm_one``)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    if jobs <= 1 or not tasks:
        return 0, []
    errors, done = [], 0
    try:
        with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
            for err in pool.map(warm or _warm_one, tasks, chunksize=max(1, len(tasks) // (4 * jobs))):
                done += err is None
                if err:
                    errors.append(err)
    except Exception as exc:  # no pool (sandbox, CUDA in workers): compile on first launch instead
        errors.append(f"pool: {exc!r}"[:300])
    return done, errors


def _warm_one(task) -> str | None:
    m, n, k, cfg, acc = task
    try:
        from kernels.linear import triton as kt

        kt.warmup(m, n, k, torch.bfloat16, cfg, accumulate=acc)
        return None
    except Exception as exc:
        return f"{cfg.short()} M{m} N{n} K{k}: {exc!r}"[:300]


def sweep_one(name, m, n, k, acc_on, ws, configs, progress, task, retime: int, rep: tuple[int, int]) -> dict:
    dev, dt = ws[0].device, ws[0].dtype
    x = torch.randn(m, k, device=dev, dtype=dt)
    acc = torch.randn(m, n, device=dev, dtype=dt) if acc_on else None
    want = reference.linear(x, ws[0], accumulate=acc.clone() if acc_on else None).float()
    wbytes = len(ws) * ws[0].numel() * ws[0].element_size()
    row = {"shape": name, "M": m, "N": n, "K": k, "copies": len(ws), "configs": {}}

    acc_t = acc.clone() if acc_on else None  # timing accumulates into this one; checks start from acc

    def timed(cfg, rep_ms):
        ms = time_ms(gemms(cfg, x, ws, acc_t), rep_ms)
        return {"us_per_gemm": ms * 1e3 / len(ws), "tb_s": wbytes / (ms * 1e-3) / 1e12}

    row["cublas"] = dict(timed(None, rep[1]), max_err=check(None, x, ws[0], acc, want))
    for cfg in configs:
        key = cfg.short()
        try:
            err = check(cfg, x, ws[0], acc, want)
            rec = {"max_err": err, "ok": err <= TOL}
            if cfg.split_k > 1 and rec["ok"]:  # the split reduction's order is fixed: the same bits again
                rec["ok"] = rec["repeatable"] = bool(torch.equal(run_one(cfg, x, ws[0], acc),
                                                                 run_one(cfg, x, ws[0], acc)))
            if rec["ok"]:
                rec.update(timed(cfg, rep[0]))
        except Exception as exc:  # compile failure, out of resources: reported and skipped
            rec = {"ok": False, "error": repr(exc)[:300]}
        row["configs"][key] = dict(rec, config=cfg.literal())
        progress.advance(task)
    ok = sorted((r["us_per_gemm"], key) for key, r in row["configs"].items() if r.get("ok"))
    # the few fastest again with longer repeats, and split ones also with the kernel reduction
    finals = {}
    for _, key in ok[:retime]:
        cfg = eval(row["configs"][key]["config"], {"LinearConfig": LinearConfig})
        finals[key] = timed(cfg, rep[1])
        if cfg.split_k > 1:
            alt = LinearConfig(cfg.block_m, cfg.block_n, cfg.block_k, split_k=cfg.split_k, num_warps=cfg.num_warps,
                               num_stages=cfg.num_stages, reduce="kernel")
            try:
                err = check(alt, x, ws[0], acc, want)
                rec = dict(timed(alt, rep[1]), max_err=err, ok=err <= TOL, config=alt.literal())
            except Exception as exc:
                rec = {"ok": False, "error": repr(exc)[:300], "config": alt.literal()}
            row["configs"][alt.short()] = rec
            if rec.get("ok"):
                finals[alt.short()] = {k2: rec[k2] for k2 in ("us_per_gemm", "tb_s")}
    for key, rec in finals.items():
        row["configs"][key]["final"] = rec
    if finals:
        best = min(finals, key=lambda k2: finals[k2]["us_per_gemm"])
        row["best"] = dict(finals[best], key=best, config=row["configs"][best]["config"])
    return row


def ceiling(dev, smoke: bool) -> dict:
    """Plain read bandwidth: sum over a 4 GB tensor, and a 2 GB copy (read + write)."""
    n = (1 << 20) if smoke else (2 << 30)
    t = torch.ones(n, device=dev, dtype=torch.bfloat16)
    out = torch.empty((), device=dev, dtype=torch.float32)
    sum_ms = time_ms(lambda: torch.sum(t, dim=0, dtype=torch.float32, out=out), 100)
    half = t[: n // 2]
    dst = torch.empty_like(half)
    copy_ms = time_ms(lambda: dst.copy_(half), 100)
    return {"sum_bytes": t.numel() * 2, "sum_tb_s": t.numel() * 2 / (sum_ms * 1e-3) / 1e12,
            "copy_tb_s": 2 * half.numel() * 2 / (copy_ms * 1e-3) / 1e12}


def layer_stack(weights: dict, best: dict, m: int, dev) -> dict:
    """32 x (q|k|v, o, gate|up, down onto the residual) at m rows: the best configs against cuBLAS."""
    from kernels.linear import linear

    k = weights["qkv"][0].shape[1]
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    act = torch.randn(m, weights["down"][0].shape[1], device=dev, dtype=torch.bfloat16)
    h = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    layers = list(zip(*(weights[s] for s in ("qkv", "o", "gate_up", "down"))))
    cfg = {s: best.get((s, m)) for s in ("qkv", "o", "gate_up", "down")}

    def cublas():
        for wq, wo, wg, wd in layers:
            F.linear(x, wq), F.linear(x, wo), F.linear(x, wg), h.addmm_(act, wd.t())

    def ours():
        for wq, wo, wg, wd in layers:
            linear(x, wq, backend="triton", config=cfg["qkv"])
            linear(x, wo, backend="triton", config=cfg["o"])
            linear(x, wg, backend="triton", config=cfg["gate_up"])
            linear(act, wd, accumulate=h, backend="triton", config=cfg["down"])

    wbytes = sum(w.numel() * 2 for ws in layers for w in ws)
    res = {"M": m, "configs": {s: (c.literal() if c else "table/heuristic") for s, c in cfg.items()}}
    for name, fn in (("cublas", cublas), ("triton", ours)):
        ms = time_ms(fn, 200)
        res[name] = {"ms": ms, "tb_s": wbytes / (ms * 1e-3) / 1e12}
    return res


class _PlainProgress:
    """rich's Progress as lines, for a device image without rich."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def add_task(self, text, total):
        print(text, flush=True)
        return text

    def advance(self, task):
        pass


def print_results(results: dict) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text
        Console = Table = None
    head = ("shape", "M", "cuBLAS us", "TB/s", "best Triton", "us", "TB/s", "vs cuBLAS", "configs ok/all")
    rows = []
    for r in results["rows"]:
        b, c = r.get("best"), r["cublas"]
        ok = sum(1 for v in r["configs"].values() if v.get("ok"))
        rows.append((r["shape"], str(r["M"]), f"{c['us_per_gemm']:.1f}", f"{c['tb_s']:.2f}",
                     b["key"] if b else "-", f"{b['us_per_gemm']:.1f}" if b else "-", f"{b['tb_s']:.2f}" if b else "-",
                     f"{c['us_per_gemm'] / b['us_per_gemm']:.2f}x" if b else "-", f"{ok}/{len(r['configs'])}"))
    title = f"skinny GEMM, {results['device']} (us per GEMM / TB/s of weights)"
    if Table is None:
        con = type("Plain", (), {"print": staticmethod(lambda s: print(s.replace("[yellow]", "")))})()
        print(title)
        for row in (head, *rows):
            print(" | ".join(row))
    else:
        con = Console(width=160)
        t = Table(title=title)
        for col in head:
            t.add_column(col)
        for row in rows:
            t.add_row(*row)
        con.print(t)
    if results.get("ceiling"):
        c = results["ceiling"]
        con.print(f"read ceiling: sum {c['sum_tb_s']:.2f} TB/s, copy (read + write) {c['copy_tb_s']:.2f} TB/s")
    for s in results.get("layer_stack", []):
        con.print(f"layer stack M={s['M']}: cuBLAS {s['cublas']['ms']:.3f} ms ({s['cublas']['tb_s']:.2f} TB/s), "
                  f"Triton {s['triton']['ms']:.3f} ms ({s['triton']['tb_s']:.2f} TB/s)")
    bad = [(r["shape"], r["M"], k) for r in results["rows"] for k, v in r["configs"].items() if not v.get("ok")]
    if bad:
        con.print(f"[yellow]{len(bad)} configs failed the check or did not compile (see the JSON), e.g. {bad[:5]}")
    con.print("\n# paste into kernels/linear/config.py (best per (N, K) and M; cuBLAS faster where marked: None there)")
    print(config_table(results["rows"]))


def config_table(rows: list[dict]) -> str:
    by_shape: dict[tuple[int, int], list[str]] = {}
    for r in sorted(rows, key=lambda r: (r["N"], r["K"], r["M"])):
        if r.get("best"):
            note = "" if r["best"]["us_per_gemm"] < r["cublas"]["us_per_gemm"] else "  # cuBLAS faster"
            by_shape.setdefault((r["N"], r["K"]), []).append(f"        ({r['M']}, {r['best']['config']}),{note}")
    lines = ["CONFIGS: dict[tuple[int, int], tuple[tuple[int, LinearConfig], ...]] = {"]
    for (n, k), entries in by_shape.items():
        lines += [f"    ({n}, {k}): ("] + entries + ["    ),"]
    return "\n".join(lines + ["}"])


# --tma-ab: name -> (kind, N, K, rows, distinct weights); kind "swiglu": N is gate|up's 2 * inter rows
TMA_AB_CASES = {"qkv": ("plain", 6144, 4096, 64, 32), "o": ("plain", 4096, 4096, 64, 32),
                "gate_up": ("swiglu", 28672, 4096, 64, 32), "down": ("accumulate", 4096, 14336, 64, 32),
                "lm_head": ("plain", 128256, 4096, 1, 4)}
SMOKE_TMA_CASES = {"qkv": ("plain", 96, 128, 3, 2), "o": ("plain", 128, 128, 3, 2),
                   "gate_up": ("swiglu", 192, 128, 3, 2), "down": ("accumulate", 128, 96, 3, 2),
                   "lm_head": ("plain", 200, 128, 1, 2)}
TMA_SMEM_LIMIT = 224 * 1024  # of the H100's 227 KB: every stage of x and weight tiles, + barriers and scratch
TMA_AB_PDL_STEPS = 2  # the layer stack's PDL variants: kernels.linear.triton.PDL_PREFETCH_STEPS (measured best)


def tma_grid(kind: str, m: int, n: int, k: int) -> list[LinearConfig]:
    """The TMA configs --tma-ab times for one launch (n: the weight's rows): weight tiles by TMA ("w") or x
    tiles too ("xw"), BLOCK_N 32-128 (256 at <= 16 rows), BLOCK_K 128 / 256, 3-8 stages (every stage of
    x and weight tiles in shared memory), 4 warps (8 too for 64 x >= 64 tiles); pruned as the pointer grid
    is: programs for at least half the SMs, at least MIN_IN_FLIGHT weight bytes in flight a program."""
    bm = block_ms(m)[0]
    rows_per_col = 2 if kind == "swiglu" else 1  # SwiGLU tiles stream gate and up rows: block_n each
    width = n // rows_per_col
    out = []
    for mode in ("w", "xw"):
        for bn in (32, 64, 128) + ((256,) if m <= 16 else ()):
            if -(-m // bm) * -(-width // bn) < SMS // 2:
                continue
            for bk in (128, 256):
                for st in (3, 4, 5, 6, 8):
                    rows = rows_per_col * bn
                    if st * (bm + rows) * bk * 2 > TMA_SMEM_LIMIT or (st - 1) * rows * bk * 2 < MIN_IN_FLIGHT:
                        continue
                    for w in ((4, 8) if bm >= 64 and bn >= 64 else (4,)):
                        out.append(LinearConfig(bm, bn, bk, num_warps=w, num_stages=st, tma=mode))
    return out


def tma_ab_pointer(kind: str, m: int, n: int, k: int) -> LinearConfig:
    """The pointer kernel's config today (kernels/linear/config.py's table, else its heuristic; SwiGLU's derived)."""
    from kernels.linear import triton as kt

    return kt.swiglu_config(m, n // 2, k) if kind == "swiglu" else kt.pick_config(m, n, k)


def tma_ab_smoke_grid(kind: str, m: int, n: int, k: int) -> list[LinearConfig]:
    return [LinearConfig(16, 32, 32, num_stages=2, tma="w"), LinearConfig(16, 32, 64, num_stages=2, tma="xw")]


def tma_ab_variants(cases: dict) -> list[tuple]:
    """Every kernel --tma-ab launches, as (m, n, k, cfg, accumulate, swiglu, pdl) with n the output width:
    the TMA grid, the pointer configs beside it and the pointer twins of the TMA configs."""
    out = []
    for kind, n, k, m, _ in cases.values():
        width = n // 2 if kind == "swiglu" else n
        cfgs = tma_grid(kind, m, n, k) + [tma_ab_pointer(kind, m, n, k)]
        cfgs += [dataclasses.replace(c, tma="off") for c in cfgs if c.tma == "w"]
        out += [(m, width, k, c, kind == "accumulate", kind == "swiglu", -1) for c in dict.fromkeys(cfgs)]
        if m > 1:  # the layer stack's pointer launches with PDL, and TMA at their tiles (the best TMA ones
            ptr = tma_ab_pointer(kind, m, n, k)  # compile when first run)
            out += [(m, width, k, c, kind == "accumulate", kind == "swiglu", TMA_AB_PDL_STEPS)
                    for c in (ptr, dataclasses.replace(ptr, tma="w"))]
    return out


def _warm_tma(task) -> str | None:
    m, n, k, cfg, acc, swiglu, pdl = task
    try:
        from kernels.linear import triton as kt

        kt.warmup(m, n, k, torch.bfloat16, cfg, accumulate=acc, swiglu=swiglu, pdl=pdl)  # TMA configs too
        return None
    except Exception as exc:
        return f"{cfg.short()} M{m} N{n} K{k}: {exc!r}"[:300]


def _tma_call(kind: str, x, acc, pdl: int = -1):
    """fn(cfg, w) -> the launch as the model makes it (cfg None: cuBLAS; gate|up then unfused, without SiLU);
    ``pdl`` >= 0: the kernel as a programmatic dependent launch asking L2 for that many weight steps first
    (PDL launches it so with kernels.linear.triton.PDL_PREFETCH_STEPS)."""
    from kernels.linear import triton as kt

    def call(cfg, w):
        if cfg is None:
            return acc.addmm_(x, w.t()) if kind == "accumulate" else F.linear(x, w)
        if kind == "swiglu":
            return kt.linear_swiglu(x, w, config=cfg, pdl=pdl)
        return kt.linear(x, w, accumulate=acc if kind == "accumulate" else None, config=cfg, pdl=pdl)
    return call


def tma_ab_case(name: str, case: tuple, ws: list, dev, rep: tuple[int, int], progress, smoke: bool) -> dict:
    """One launch: cuBLAS, the pointer config of today, every TMA config of the grid (each checked against the
    twin on weight 0 first, then timed over the distinct weights), then the fastest TMA configs, the pointer
    kernel at their tiles and the two references again with longer repeats."""
    kind, n, k, m, _ = case
    x = (torch.randn(m, k, device=dev) * 0.5).to(torch.bfloat16)
    acc0 = torch.randn(m, n, device=dev).to(torch.bfloat16) if kind == "accumulate" else None
    acc_t = acc0.clone() if acc0 is not None else None  # timing accumulates into this one
    w0 = ws[0]
    want = (reference.linear_swiglu(x, w0) if kind == "swiglu" else
            reference.linear(x, w0, accumulate=acc0.clone() if acc0 is not None else None)).float()
    tol = TOL_AB if kind == "swiglu" else TOL
    wbytes = len(ws) * w0.numel() * w0.element_size()
    timed_call = _tma_call(kind, x, acc_t)
    pointer = tma_ab_pointer(kind, m, n, k)
    configs = (tma_ab_smoke_grid if smoke else tma_grid)(kind, m, n, k)
    row = {"shape": name, "kind": kind, "M": m, "N": n, "K": k, "copies": len(ws), "pointer": pointer.literal(),
           "configs": {}}

    def measure(cfg, rep_ms) -> dict:
        rec = {"config": cfg.literal() if cfg else "cuBLAS"}
        try:
            raw = _tma_call(kind, x, acc0.clone() if acc0 is not None else None)(cfg, w0)
            got = raw.float()
            if kind == "swiglu" and cfg is None:  # cuBLAS computes gate|up; the activation as the twin rounds it
                gate, up = got.to(torch.bfloat16).float().chunk(2, dim=-1)
                got = ((gate / (1.0 + torch.exp(-gate))).to(torch.bfloat16).float() * up).to(torch.bfloat16).float()
            rec["max_err"] = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
            rec["ok"] = rec["max_err"] <= tol
            if rec["ok"] and cfg is not None and cfg.tma != "off":  # the pointer kernel at the same tiles
                try:
                    twin = _tma_call(kind, x, acc0.clone() if acc0 is not None else None)(
                        dataclasses.replace(cfg, tma="off"), w0)
                    rec["same_bits_as_pointer"] = bool(torch.equal(twin, raw))
                except Exception as exc:  # its tiles past shared memory: nothing to compare
                    rec["same_bits_as_pointer"] = repr(exc)[:100]
            if rec["ok"]:
                ms = time_ms(lambda: [timed_call(cfg, w) for w in ws], rep_ms)
                rec.update(us=ms * 1e3 / len(ws), tb_s=wbytes / (ms * 1e-3) / 1e12)
        except Exception as exc:  # compile failure, out of resources: reported and skipped
            rec.update(ok=False, error=repr(exc)[:300])
        return rec

    task = progress.add_task(f"TMA A/B {name} M={m} ({len(configs)} TMA configs)", total=len(configs) + 8)
    for cfg in configs:
        row["configs"][cfg.short()] = measure(cfg, rep[0])
        progress.advance(task)
    fastest = sorted((r["us"], key) for key, r in row["configs"].items() if "us" in r)[:3]
    finals = {"cuBLAS": None, f"pointer {pointer.short()}": pointer}
    for _, key in fastest:
        cfg = eval(row["configs"][key]["config"], {"LinearConfig": LinearConfig})
        finals[key] = cfg
        twin = dataclasses.replace(cfg, tma="off")
        if twin != pointer:
            finals[f"pointer {twin.short()}"] = twin
    row["final"] = {}
    for label, cfg in finals.items():
        row["final"][label] = measure(cfg, rep[1])
        progress.advance(task)
    tma_final = {key: r for key, r in row["final"].items() if "tma-" in key and "us" in r}
    if tma_final:
        best = min(tma_final, key=lambda key: tma_final[key]["us"])
        row["best_tma"] = dict(tma_final[best], key=best)
    return row


def tma_stack(weights: dict, best: dict, m: int, dev, rep: int) -> dict:
    """32 layers of (q|k|v, o, gate|up SwiGLU, down onto the residual) at m rows in one graph: the pointer configs
    of today against the best TMA config per launch (cuBLAS beside them, gate|up unfused without SiLU), each
    Triton way also as programmatic dependent launches (TMA_AB_PDL_STEPS weight steps asked for first)."""
    x = torch.randn(m, weights["qkv"][0].shape[1], device=dev).to(torch.bfloat16)
    act = torch.randn(m, weights["down"][0].shape[1], device=dev).to(torch.bfloat16)
    h = torch.randn(m, weights["down"][0].shape[0], device=dev).to(torch.bfloat16)
    kinds = {s: TMA_AB_CASES[s][0] if s in TMA_AB_CASES else SMOKE_TMA_CASES[s][0] for s in weights}
    pdl = TMA_AB_PDL_STEPS if dev.type == "cuda" else -1  # the interpreter has no PDL
    calls = {p: {s: _tma_call(kinds[s], act if s == "down" else x, h, p) for s in weights} for p in (-1, pdl)}
    layers = list(zip(*(weights[s] for s in ("qkv", "o", "gate_up", "down"))))
    pointer = {s: tma_ab_pointer(kinds[s], m, *weights[s][0].shape) for s in weights}
    ways = {"cuBLAS": ({s: None for s in weights}, -1), "pointer": (pointer, -1), "tma": (best, -1),
            "pointer pdl": (pointer, pdl), "tma pdl": (best, pdl)}
    wbytes = sum(w.numel() * 2 for ws in layers for w in ws)
    res = {"M": m, "pdl_steps": pdl, "configs": {way: {s: c.literal() if c else "cuBLAS" for s, c in cfg.items()}
                                                 for way, (cfg, _) in ways.items() if "pdl" not in way}}
    for way, (cfg, p) in ways.items():
        def fn(cfg=cfg, p=p):
            for layer in layers:
                for s, w in zip(("qkv", "o", "gate_up", "down"), layer):
                    calls[p][s](cfg[s], w)
        try:
            ms = time_ms(fn, rep)
            res[way] = {"ms": ms, "tb_s": wbytes / (ms * 1e-3) / 1e12}
        except Exception as exc:  # reported, the other ways still timed
            res[way] = {"error": repr(exc)[:300]}
    return res


def tma_ab(args, dev, progress) -> dict:
    """The --tma-ab run: every case of TMA_AB_CASES (SMOKE_TMA_CASES with --smoke), then the layer stack."""
    cases = SMOKE_TMA_CASES if args.smoke else TMA_AB_CASES
    out = {"rows": [], "cases": {s: list(c) for s, c in cases.items()}}
    if dev.type == "cuda":
        t0 = time.perf_counter()
        done, out["compile_errors"] = precompile(tma_ab_variants(cases), args.jobs, _warm_tma)
        print(f"  {done} kernels compiled in {time.perf_counter() - t0:.0f} s", flush=True)
    rep = (1, 1) if args.smoke else (10, 50)
    weights, best = {}, {}
    for name, case in cases.items():
        kind, n, k, m, copies = case
        ws = [(torch.randn(n, k, device=dev) * k ** -0.5).to(torch.bfloat16) for _ in range(copies)]
        row = tma_ab_case(name, case, ws, dev, rep, progress, args.smoke)
        out["rows"].append(row)
        if row.get("best_tma"):
            best[name] = eval(row["best_tma"]["config"], {"LinearConfig": LinearConfig})
        if name != "lm_head":
            weights[name] = ws
        del ws
    if set(weights) >= {"qkv", "o", "gate_up", "down"} and all(s in best for s in weights):
        m = cases["qkv"][3]
        out["layer_stack"] = tma_stack(weights, best, m, dev, 1 if args.smoke else 200)
    return out


def print_tma_ab(res: dict) -> None:
    print(f"TMA A/B, {res['device']} (us per launch over distinct weights / TB/s of weights read)")
    for r in res["rows"]:
        ok = sum(1 for v in r["configs"].values() if v.get("ok"))
        print(f"  {r['shape']} ({r['kind']}, M{r['M']} N{r['N']} K{r['K']}, {ok}/{len(r['configs'])} TMA configs "
              f"passed the check)")
        for label, f in sorted(r["final"].items(), key=lambda kv: kv[1].get("us", float("inf"))):
            if "us" in f:
                same = {True: "  same bits as the pointer kernel", False: "  bits differ from the pointer kernel"}
                print(f"    {label:44s} {f['us']:8.1f} us  {f['tb_s']:5.2f} TB/s  err {f['max_err']:.1e}"
                      f"{same.get(f.get('same_bits_as_pointer'), '')}")
            else:
                print(f"    {label:44s} FAILED {f.get('error') or 'max err %.1e' % f['max_err']}")
    s = res.get("layer_stack")
    if s:
        print(f"  layer stack M={s['M']} (32 x q|k|v, o, gate|up, down; pdl: PDL launches, {s['pdl_steps']} steps):")
        for way in ("cuBLAS", "pointer", "tma", "pointer pdl", "tma pdl"):
            r = s[way]
            took = f"{r['ms']:.3f} ms ({r['tb_s']:.2f} TB/s)" if "ms" in r else f"FAILED {r['error']}"
            print(f"    {way:12s} {took}")
    print("\n# best TMA config per launch, as kernels/linear/config.py's CONFIGS entries take them (gate|up: the"
          "\n# unfused [2I, K] entry, whose block_n swiglu_config halves); keep the pointer entry where it was faster")
    for r in res["rows"]:
        pointer = eval(r["pointer"], {"LinearConfig": LinearConfig})
        b, p = r.get("best_tma"), r["final"].get(f"pointer {pointer.short()}", {})
        if not b:
            continue
        cfg = eval(b["config"], {"LinearConfig": LinearConfig})
        if r["kind"] == "swiglu":
            cfg = dataclasses.replace(cfg, block_n=2 * cfg.block_n)
        verdict = f"{p['us'] / b['us']:.3f}x the pointer config's speed" if "us" in p else "pointer config failed"
        print(f"    ({r['N']}, {r['K']}): (({r['M']}, {cfg.literal()}), ...)  # {r['shape']}: {verdict}")


def variants(shapes: dict, ms, quick: bool) -> dict:
    """Every distinct kernel compilation of the sweep: key -> (m, n, k, cfg, accumulate)."""
    from kernels.linear.triton import split_plan

    out = {}
    for n, k, acc, _ in shapes.values():
        for m in ms:
            for cfg in grid(m, n, k, quick):
                per, n_split = split_plan(k, cfg.block_k, cfg.split_k)
                key = (m == 1, m % 16 == 0, cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages,
                       n_split > 1, k % per == 0, acc)
                out.setdefault(key, (m, n, k, cfg, acc))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("skinny_gemm.json"))
    ap.add_argument("--quick", action="store_true", help="a smaller grid (BLOCK_N 64/128, BLOCK_K 128/256, 4 warps)")
    ap.add_argument("--ms", help=f"rows to sweep (default {','.join(map(str, MS))})")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="compiling processes")
    ap.add_argument("--retime", type=int, default=4, help="fastest configs re-timed with longer repeats")
    ap.add_argument("--budget-s", type=float, default=150.0,
                    help="past this many seconds of sweeping, the remaining (shape, M) take the quick grid")
    ap.add_argument("--compile-only", action="store_true", help="no GPU: compile every variant for sm_90")
    ap.add_argument("--smoke", action="store_true", help="no GPU: tiny shapes on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--tma-ab", action="store_true",
                    help="only the TMA weight stream's A/B (see the module's docstring)")
    args = ap.parse_args()
    if args.compile_only:
        from compile_linear_sm90 import compile_all

        if args.tma_ab:
            return compile_all(tma_ab_variants(TMA_AB_CASES), args.jobs, verbose=True)
        return compile_all(list(variants(SHAPES, MS, args.quick).values()), args.jobs)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --smoke (with TRITON_INTERPRET=1) or --compile-only")
    if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--smoke runs the kernel under the interpreter: set TRITON_INTERPRET=1")
    import triton
    try:
        from rich.progress import Progress
    except ImportError:
        Progress = _PlainProgress

    dev = torch.device("cpu" if args.smoke else "cuda")
    if args.tma_ab:
        results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter smoke)",
                   "torch": torch.__version__, "triton": triton.__version__, "tolerance": [TOL, TOL_AB]}
        t0 = time.perf_counter()
        with Progress() as progress:
            results.update(tma_ab(args, dev, progress))
        results["elapsed_s"] = time.perf_counter() - t0
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
        print_tma_ab(results)
        return 0 if all(r.get("best_tma") for r in results["rows"]) else 1
    shapes = SMOKE_SHAPES if args.smoke else {s: SHAPES[s] for s in args.shapes.split(",")}
    ms = (1, 8) if args.smoke else tuple(int(m) for m in (args.ms or ",".join(map(str, MS))).split(","))
    make_grid = smoke_grid if args.smoke else grid
    rep = (1, 1) if args.smoke else (3, 25)
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter smoke)",
               "torch": torch.__version__, "triton": triton.__version__, "quick": args.quick, "tolerance": TOL,
               "rows": [], "compile_errors": []}
    t0 = time.perf_counter()
    results["ceiling"] = ceiling(dev, args.smoke)
    if dev.type == "cuda":
        tasks = variants(shapes, ms, args.quick)
        print(f"compiling {len(tasks)} kernel variants on {args.jobs} processes", flush=True)
        done, results["compile_errors"] = precompile(list(tasks.values()), args.jobs)
        results["precompile_s"] = time.perf_counter() - t0
        print(f"  {done} compiled in {results['precompile_s']:.0f} s, {len(results['compile_errors'])} errors",
              flush=True)
    weights, best = {}, {}
    keep = {"qkv", "o", "gate_up", "down"}
    with Progress() as progress:
        for name, (n, k, acc, copies) in shapes.items():
            ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            for m in ms:
                quick = args.quick or time.perf_counter() - t0 > args.budget_s
                configs = make_grid(m, n, k, quick)
                task = progress.add_task(f"{name} M={m} ({len(configs)} configs)", total=len(configs))
                row = sweep_one(name, m, n, k, acc, ws, configs, progress, task, args.retime, rep)
                row["grid"] = "quick" if quick else "full"
                results["rows"].append(row)
                if row.get("best"):
                    best[(name, m)] = eval(row["best"]["config"], {"LinearConfig": LinearConfig})
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(results, indent=1))
            if name in keep:
                weights[name] = ws
            del ws
    if keep <= set(weights):  # every layer shape swept (~14 GB of weights kept on the GPU)
        results["layer_stack"] = [layer_stack(weights, best, m, dev) for m in (64, 8)]
    results["elapsed_s"] = time.perf_counter() - t0
    args.out.write_text(json.dumps(results, indent=1))
    print_results(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
