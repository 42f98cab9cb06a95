"""Short-query prefill attention (issue #2's ratio-0 pass): a 64-token suffix over 6 x 512 cached tokens.

The engine benchmark's ``tessera@0`` pass runs one attention call per layer for the suffix alone:
64 queries x 32 heads over ~3,200 keys in 7 offset groups (6 chunks, then the private suffix blocks).
Few query tiles, so the kernel's grid comes from KV splits. This script times the Triton prefill
kernel's launch shapes and short-query knobs (PrefillConfig: tile rows, warps, keys a step, KV splits,
exact tiles, the merge) beside SDPA over keys already rotated and laid out
contiguously (lower-right causal), all replayed as CUDA graphs with the per-step key bounds computed
once (as the engine's static tail does). Two timings per variant:
  warm: the same call replayed, its 12.8 MB of K/V resident in L2 (what earlier rounds measured);
  cold: one call per layer over LAYERS layers' own K/V caches (~100 MB, past L2), as in the engine,
        where every layer's K/V comes from HBM.
Each variant is first checked against the twin (kernels/paged_attention/reference.py) on the GPU; one
that fails to compile or to match is reported and skipped.
The knobs that measured slower here were removed from the kernel with their variants (the split programs merging
their own partials, splits of whole steps, K/V prefetched to L2, 32-bit step indices, 16-bit partials); their
figures stay in bench/short_attention/README.md and bench/HISTORY.md.

    python3 bench/short_attention/short_attention.py --out bench/short_attention/short_attention.json [--new 64,528] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "kernels")]

import torch  # noqa: E402
import triton  # noqa: E402

from kernels.lse_merge.triton import merge_rows  # noqa: E402
from kernels.paged_attention import _prefill, paged_prefill_attention  # noqa: E402
from kernels.paged_attention._meta import pack  # noqa: E402
from kernels.rope import rope_inv_freq  # noqa: E402

PC = _prefill.PrefillConfig
LAYERS = 8  # x 12.8 MB of K/V: well past the H100's 50 MB of L2


def _bench_kernels():
    """bench/kernels/kernels.py (the paged layout and the SDPA peer), loaded by path: its name is the package's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_kernels", REPO / "bench" / "kernels" / "kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


kb = _bench_kernels()


def graph_ms(fn) -> float:
    """Median ms of fn replayed as a CUDA graph (launch overhead out, as in the engine's static tails)."""
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def variants(new: int, quick: bool) -> list[PC]:
    """The engine's default first, then the earlier sweep's shapes and the remaining short-query knobs."""
    if new > 128:  # ratio 0.15's tail: the default's neighbours
        out = [PC()] + [PC(**kw, num_splits=s) for kw in ({}, dict(merge="all")) for s in (2, 3, 4)]
        return out[:4] if quick else out
    exact = dict(exact_tiles=True)
    out = [PC()]
    out += [PC(num_splits=s) for s in (4, 6, 8)]
    out += [PC(block_m=128, num_warps=8, num_splits=s) for s in (6, 8)]
    out += [PC(**exact, num_splits=s) for s in (6, 8, 12, 16)]
    out += [PC(**exact, merge="all", num_splits=s) for s in (8, 12, 16)]
    out += [PC(**exact, min_block_n=128, num_splits=s) for s in (6, 8, 12)]
    out += [PC(**exact, num_stages=3, num_splits=s) for s in (8, 12)]
    out += [PC(**exact), PC(**exact, min_split_steps=6)]  # automatic counts (the second: SHORT_PREFILL)
    return out[:6] if quick else out


def name(c: PC) -> str:
    knobs = [f"{c.block_m}x{c.min_block_n}", f"w{c.num_warps}", f"s{c.num_stages}", f"splits={c.num_splits or 'auto'}"]
    knobs += [f"min{c.min_split_steps}"] if c.min_split_steps != PC().min_split_steps else []
    knobs += [k for k, on in (("exact", c.exact_tiles), ("merge-all", c.merge == "all")) if on]
    return "/".join(knobs)


def scenario(ctx: int, chunk: int, new: int, bs: int, dev, inv, quick: bool, pad: bool, save=lambda res: None) -> dict:
    """One shape: the peer, then every variant; save(res) after each (a crash loses nothing timed before it)."""
    p = kb.paged(1, ctx, chunk, new, bs, dev)
    k4, v4 = kb.contiguous_kv(p, inv)  # the peer's keys, before the table is padded
    if pad:  # as the engine's static tail: entries padded to 256 key slots, naming a block with no slot visible
        n_pad = -p["block_ids"].numel() % max(1, 256 // bs)
        z = torch.zeros(n_pad, dtype=torch.int32, device=dev)
        p["block_ids"], p["offsets"] = torch.cat([p["block_ids"], z]), torch.cat([p["offsets"], z])
        p["masks"] = torch.cat([p["masks"], z.long()])
        p["cu_entries"] = torch.tensor([0, p["block_ids"].numel()], dtype=torch.int32, device=dev)
    q = torch.randn((new, kb.HQ, kb.D), device=dev, dtype=torch.bfloat16)
    q_pos = torch.arange(ctx, ctx + new, device=dev, dtype=torch.int32)
    cu_q = torch.tensor([0, new], device=dev, dtype=torch.int32)
    scale = kb.D ** -0.5
    packed = pack(p["block_ids"], p["offsets"], p["masks"], bs, inv, with_table=True, cu_entries=p["cu_entries"])
    # LAYERS copies of the caches (same table, same slot positions), one per "layer"
    caches = [(p["k_cache"], p["v_cache"])] + [(p["k_cache"].clone(), p["v_cache"].clone()) for _ in range(LAYERS - 1)]
    want, _ = paged_prefill_attention(q.float(), q_pos, p["k_cache"].float(), p["v_cache"].float(), p["slot_pos"],
                                      p["block_ids"], p["offsets"], p["masks"], cu_q, p["cu_entries"], inv, scale,
                                      backend="torch")
    res = {"ctx": ctx, "chunk": chunk, "new": new, "block_size": bs, "layers_cold": LAYERS,
           "entries": p["block_ids"].numel(), "variants": {}}
    peers = [(k4, v4)] + [(k4.clone(), v4.clone()) for _ in range(LAYERS - 1)]
    q4 = q.transpose(0, 1).unsqueeze(0).contiguous()
    call, res["sdpa_backend"], res["sdpa_rel"] = kb.sdpa_peer(q4, k4, v4, True, want.transpose(0, 1).unsqueeze(0))
    res["sdpa_ms"] = graph_ms(lambda: call(k4, v4))
    res["sdpa_cold_ms"] = graph_ms(lambda: [call(k, v) for k, v in peers]) / LAYERS
    print(f"ctx {ctx} + {new} new: SDPA ({res['sdpa_backend']}) warm {res['sdpa_ms'] * 1e3:.1f} us, "
          f"cold {res['sdpa_cold_ms'] * 1e3:.1f} us", flush=True)
    key_hi = {}  # per keys-a-step: computed once, as the engine's static tail does per replay
    for c in variants(new, quick):
        t0 = time.perf_counter()
        nb = max(1, c.min_block_n // bs)
        try:
            if nb not in key_hi:
                key_hi[nb] = _prefill.step_key_bounds(packed, p["slot_pos"], bs, nb)
                res[f"key_bounds_nb{nb}_ms"] = graph_ms(lambda: _prefill.step_key_bounds(packed, p["slot_pos"], bs, nb))
            run = lambda k, v, c=c, hi=key_hi[nb]: _prefill.launch(q, q_pos, k, v, p["slot_pos"], packed, cu_q, inv,  # noqa: E731
                                                                   scale, cfg=c, key_hi=hi)
            out, _ = run(*caches[0])
            torch.cuda.synchronize()
            err = kb.rel(out, want)
            if not err < 2e-2:
                raise RuntimeError(f"wrong result: rel err {err:.3g} against the twin")
            ms = graph_ms(lambda: run(*caches[0]))
            cold = graph_ms(lambda: [run(k, v) for k, v in caches]) / LAYERS
        except Exception as exc:  # a shape Triton cannot compile (registers, shared memory), or a wrong one
            res["variants"][name(c)] = {"error": repr(exc)[:300], "cfg": dataclasses.asdict(c)}
            print(f"  {name(c)}: SKIPPED {repr(exc)[:200]}", flush=True)
            continue
        row = {"ms": ms, "cold_ms": cold, "rel_vs_twin": err, "ok": True, "cfg": dataclasses.asdict(c)}
        splits = c.num_splits or 0
        if splits > 1:
            parts = torch.randn((splits, new * kb.HQ, kb.D), device=dev)
            lses = torch.randn((splits, new * kb.HQ), device=dev)
            row["merge_ms"] = graph_ms(lambda: merge_rows(parts, lses, torch.bfloat16, all_parts=c.merge == "all"))
        res["variants"][name(c)] = row
        save(res)
        print(f"  {name(c)}: warm {ms * 1e3:.1f} us, cold {cold * 1e3:.1f} us, rel {err:.1e}"
              + (f", merge alone {row['merge_ms'] * 1e3:.1f} us" if "merge_ms" in row else "")
              + f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
    ok = {k: v for k, v in res["variants"].items() if v.get("ok")}
    res["best"] = min(ok, key=lambda k: ok[k]["ms"]) if ok else None
    res["best_cold"] = min(ok, key=lambda k: ok[k]["cold_ms"]) if ok else None
    return res


def compile_report(dump: Path | None) -> list:
    """No GPU: every 64-query variant compiled for sm_90 (bench/kernels/kernels.py's compile_sm90: registers, stack,
    SASS counts of the step loop), one variant at a time, the split merge stubbed out (it would launch)."""
    rows = []
    _prefill.merge_rows = lambda o, l, dt, all_parts=False: (o[0].to(dt), l[0])  # noqa: E731, E741
    for c in variants(64, False):
        for row in kb.compile_sm90([c], 16, dump):
            if row["variant"].endswith("/rot"):
                rows.append({**row, "variant": name(c)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "short_attention" / "short_attention.json")
    ap.add_argument("--new", default="64,528", help="query counts (the suffix; 528 = ratio 0.15's tail)")
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="a few variants only (checks the script)")
    ap.add_argument("--no-pad", action="store_true", help="leave the table unpadded (the engine pads it)")
    ap.add_argument("--compile-only", action="store_true", help="no GPU: compile every variant for sm_90")
    ap.add_argument("--dump-asm", type=Path, help="with --compile-only: write each variant's TTGIR and SASS here")
    args = ap.parse_args()
    if args.compile_only:
        rows = compile_report(args.dump_asm)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"triton": triton.__version__, "compile": rows}, indent=1))
        return 0
    dev = torch.device("cuda")
    inv = rope_inv_freq(kb.D, 500000.0, kb.LLAMA3).to(dev)
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "default": name(PC()), "scenarios": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(partial: dict) -> None:
        args.out.write_text(json.dumps({**results, "scenarios": results["scenarios"] + [partial]}, indent=1))

    for new in (int(n) for n in args.new.split(",")):
        results["scenarios"].append(scenario(3072, 512, new, args.bs, dev, inv, args.quick, not args.no_pad, save))
        args.out.write_text(json.dumps(results, indent=1))
    for s in results["scenarios"]:
        v = s["variants"]
        default = v.get(name(PC()), {})
        dw, dc = default.get("ms", float("nan")), default.get("cold_ms", float("nan"))
        print(f"{s['new']} queries: SDPA warm {s['sdpa_ms'] * 1e3:.1f} / cold {s['sdpa_cold_ms'] * 1e3:.1f} us; "
              f"default {dw * 1e3:.1f} / {dc * 1e3:.1f} us")
        for label, key in (("best warm", "best"), ("best cold", "best_cold")):
            if s[key]:
                print(f"  {label}: {s[key]} {v[s[key]]['ms'] * 1e3:.1f} / {v[s[key]]['cold_ms'] * 1e3:.1f} us")
        if s["best_cold"] and s["new"] <= 128:  # the engine reads K/V cold: what SHORT_PREFILL would be set to
            changed = {k: x for k, x in v[s["best_cold"]]["cfg"].items() if x != getattr(PC(), k)}
            print(f"  SHORT_PREFILL candidate: PrefillConfig({', '.join(f'{k}={x!r}' for k, x in changed.items())})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
