"""Short-query prefill attention (issue #2's ratio-0 pass): a 64-token suffix over 6 x 512 cached tokens.

The engine benchmark's ``tessera@0`` pass runs one attention call per layer for the suffix alone:
64 queries x 32 heads over ~3,200 keys in 7 offset groups (6 chunks, then the private suffix blocks).
Few query tiles, so the kernel's grid comes from KV splits. This script times the Triton prefill
kernel's launch shapes for that call (tile rows, warps, KV splits), each piece of the launch alone
(key bounds, kernel, LSE merge), beside SDPA over keys already rotated and laid out contiguously
(lower-right causal), all replayed as CUDA graphs, as the engine runs them. Each variant is checked
against the twin (kernels/paged_attention/reference.py) first.

    python3 bench/short_attention.py --out bench/short_attention.json [--new 64,528]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench"), str(REPO / "tests" / "kernels")]

import torch  # noqa: E402
import triton  # noqa: E402

from kernels.lse_merge.triton import merge_rows  # noqa: E402
from kernels.paged_attention import _prefill, paged_prefill_attention  # noqa: E402
from kernels.paged_attention._meta import pack  # noqa: E402
from kernels.rope import rope_inv_freq  # noqa: E402

PC = _prefill.PrefillConfig


def _bench_kernels():
    """bench/kernels.py (the paged layout and the SDPA peer), loaded by path: its name is the package's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_kernels", REPO / "bench" / "kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


kb = _bench_kernels()


def graph_ms(fn) -> float:
    """Median ms of fn replayed as a CUDA graph (launch overhead out, as in the engine's static tails)."""
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def variants(new: int) -> list[PC]:
    out = [PC()]
    for block_m, warps in ((64, 4), (128, 4), (128, 8), (256, 8)):
        for splits in (1, 2, 3, 4, 6, 8, 12, 16, 24):
            out.append(PC(block_m=block_m, num_warps=warps, num_splits=splits))
    return out


def name(c: PC) -> str:
    return f"{c.block_m}rows/w{c.num_warps}/s{c.num_stages}/splits={c.num_splits or 'auto'}"


def scenario(ctx: int, chunk: int, new: int, bs: int, dev, inv) -> dict:
    p = kb.paged(1, ctx, chunk, new, bs, dev)
    q = torch.randn((new, kb.HQ, kb.D), device=dev, dtype=torch.bfloat16)
    q_pos = torch.arange(ctx, ctx + new, device=dev, dtype=torch.int32)
    cu_q = torch.tensor([0, new], device=dev, dtype=torch.int32)
    scale = kb.D ** -0.5
    packed = pack(p["block_ids"], p["offsets"], p["masks"], bs, inv, with_table=True, cu_entries=p["cu_entries"])
    kv = (p["k_cache"], p["v_cache"], p["slot_pos"])
    want, _ = paged_prefill_attention(q.float(), q_pos, p["k_cache"].float(), p["v_cache"].float(), p["slot_pos"],
                                      p["block_ids"], p["offsets"], p["masks"], cu_q, p["cu_entries"], inv, scale,
                                      backend="torch")
    res = {"ctx": ctx, "chunk": chunk, "new": new, "block_size": bs, "variants": {}}
    k4, v4 = kb.contiguous_kv(p, inv)
    q4 = q.transpose(0, 1).unsqueeze(0).contiguous()
    call, res["sdpa_backend"], res["sdpa_rel"] = kb.sdpa_peer(q4, k4, v4, True, want.transpose(0, 1).unsqueeze(0))
    res["sdpa_ms"] = graph_ms(lambda: call(k4, v4))
    print(f"ctx {ctx} + {new} new: SDPA ({res['sdpa_backend']}) {res['sdpa_ms'] * 1e3:.1f} us", flush=True)
    nb = max(1, PC().min_block_n // bs)
    res["key_bounds_ms"] = graph_ms(lambda: _prefill.step_key_bounds(packed, p["slot_pos"], bs, nb))
    for c in variants(new):
        try:
            out, _ = _prefill.launch(q, q_pos, *kv, packed, cu_q, inv, scale, cfg=c)
            err = kb.rel(out, want)
            ms = graph_ms(lambda c=c: _prefill.launch(q, q_pos, *kv, packed, cu_q, inv, scale, cfg=c))
        except Exception as exc:  # a shape Triton cannot compile (registers, shared memory): say so, go on
            res["variants"][name(c)] = {"error": repr(exc)[:300]}
            print(f"  {name(c)}: {repr(exc)[:200]}", flush=True)
            continue
        row = {"ms": ms, "rel_vs_twin": err, "ok": err < 2e-2}
        if c.num_splits and c.num_splits > 1:
            parts = torch.randn((c.num_splits, new * kb.HQ, kb.D), device=dev)
            lses = torch.randn((c.num_splits, new * kb.HQ), device=dev)
            row["merge_ms"] = graph_ms(lambda: merge_rows(parts, lses, torch.bfloat16))
        res["variants"][name(c)] = row
        print(f"  {name(c)}: {ms * 1e3:.1f} us, rel {err:.1e}" + (f", merge {row['merge_ms'] * 1e3:.1f} us"
                                                                   if "merge_ms" in row else ""), flush=True)
    ok = {k: v for k, v in res["variants"].items() if v.get("ok")}
    res["best"] = min(ok, key=lambda k: ok[k]["ms"]) if ok else None
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "short_attention.json")
    ap.add_argument("--new", default="64,528", help="query counts (the suffix; 528 = ratio 0.15's tail)")
    ap.add_argument("--bs", type=int, default=16)
    args = ap.parse_args()
    dev = torch.device("cuda")
    inv = rope_inv_freq(kb.D, 500000.0, kb.LLAMA3).to(dev)
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "default": name(PC()), "scenarios": []}
    for new in (int(n) for n in args.new.split(",")):
        results["scenarios"].append(scenario(3072, 512, new, args.bs, dev, inv))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    for s in results["scenarios"]:
        best = s["variants"][s["best"]]
        default = s["variants"][name(PC())]
        print(f"{s['new']} queries: SDPA {s['sdpa_ms'] * 1e3:.1f} us, default {default['ms'] * 1e3:.1f} us, "
              f"best {s['best']} {best['ms'] * 1e3:.1f} us, key bounds {s['key_bounds_ms'] * 1e3:.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
