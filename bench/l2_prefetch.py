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

    python3 bench/l2_prefetch.py [--out DIR/l2_prefetch.json]

Outcome (H100, 2026-11-22, bench/l2_prefetch.json): an L2-resident o weight makes the GEMM 9.1 us instead of
14.6, but the prefetch branch does not overlap the stand-in (every SM is busy with it): busy then GEMM 41.6 us
a layer, with the prefetch 45.3 (half the weight) / 51.3 us (all of it). Not adopted.

``--attention``: the prefetch issued by the short attention kernel itself
(paged_prefill_packed(l2_prefetch=), what kernels.paged_attention.L2_PREFETCH_NEXT turns on in the engine):
32 layers of (the real 64-token suffix attention over 6 x 512 cached keys -> o GEMM on that layer's own weight)
captured as CUDA graphs with and without the prefetch, outputs checked equal, timed alternately.
``--compile-only`` (no GPU): the engine's short attention launch compiled for sm_90 with and without the
prefetch; the prefetch instruction must be in the PTX and the rest of the kernel's instructions unchanged.

    python3 bench/l2_prefetch.py --attention --out bench/l2_prefetch_attention.json [--pdl]
    python3 bench/l2_prefetch.py --compile-only [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

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
    ap.add_argument("--attention", action="store_true", help="the attention kernel's own prefetch of the o weight")
    ap.add_argument("--compile-only", action="store_true", help="no GPU: its sm_90 PTX with and without the prefetch")
    ap.add_argument("--rounds", type=int, default=15, help="--attention: timing rounds (variants alternate)")
    ap.add_argument("--reps", type=int, default=10, help="--attention: graph replays a variant a round")
    ap.add_argument("--pdl", action="store_true", help="--attention: kernels.pdl.ENABLED on (the prefetch precedes "
                                                       "the wait)")
    args = ap.parse_args()
    if args.compile_only:
        return compile_report(args)
    if args.attention:
        return attention_bench(args)
    return probe(args)


def probe(args) -> int:
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


# --attention: the short attention kernel asks L2 for the o weight itself ------------------------------------------

# (name, PrefillConfig.l2_mode or None for no prefetch, fraction of the weight asked for)
HINTS = [("off", None, 1.0), ("bulk", "bulk", 1.0), ("lines", "lines", 1.0), ("bulk_half", "bulk", 0.5)]
CTX, CHUNK, NEW, BS = 3072, 512, 64, 16  # bench/short_attention.py's shape: 6 x 512 cached keys, a 64-token suffix


def _bench_kernels():
    """bench/kernels.py (the paged layout of bench/short_attention.py), loaded by path: its name is the package's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_kernels", REPO / "bench" / "kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def attention_inputs(n_layers: int, dev) -> dict:
    """The engine's static-tail attention call of a tessera@0 pass: one table (padded to 256 key slots with
    entries naming a block with no slot visible, as graphs.py pads it) packed once with its key bounds, 64
    queries, and per layer its own K/V cache (12.8 MB) and o weight (4096 x 4096 bf16, 33.5 MB)."""
    from kernels.paged_attention._meta import pack
    from kernels.paged_attention.triton import prefill_key_bounds
    from kernels.rope import rope_inv_freq

    kb = _bench_kernels()
    p = kb.paged(1, CTX, CHUNK, NEW, BS, dev)
    n_pad = -p["block_ids"].numel() % max(1, 256 // BS)
    z = torch.zeros(n_pad, dtype=torch.int32, device=dev)
    ids, offs = torch.cat([p["block_ids"], z]), torch.cat([p["offsets"], z])
    masks = torch.cat([p["masks"], z.long()])
    cu_e = torch.tensor([0, ids.numel()], dtype=torch.int32, device=dev)
    inv = rope_inv_freq(kb.D, 500000.0, kb.LLAMA3).to(dev)
    packed = pack(ids, offs, masks, BS, inv, with_table=True, cu_entries=cu_e)
    g = torch.Generator(device=dev).manual_seed(5)
    return dict(
        q=torch.randn((NEW, kb.HQ, kb.D), device=dev, dtype=torch.bfloat16, generator=g),
        q_pos=torch.arange(CTX, CTX + NEW, device=dev, dtype=torch.int32), slot_pos=p["slot_pos"], packed=packed,
        cu_q=torch.tensor([0, NEW], device=dev, dtype=torch.int32), inv=inv, scale=kb.D ** -0.5,
        key_hi=prefill_key_bounds(packed, p["slot_pos"]),
        kv=[(p["k_cache"], p["v_cache"])] + [(p["k_cache"].clone(), p["v_cache"].clone()) for _ in range(n_layers - 1)],
        w=[torch.randn((kb.HQ * kb.D, kb.HQ * kb.D), device=dev, dtype=torch.bfloat16, generator=g) * 0.02
           for _ in range(n_layers)])


def _layers(inp: dict, hint: tuple, gemm: str, parts: str = "both"):
    """A body of len(inp['w']) layers: attention (with the hint's prefetch of that layer's o weight) then the o
    GEMM as Transformer._linear runs it (``skinny``: kernels/linear where it applies, else cuBLAS; ``cublas``).
    parts "attention" / "gemm": one of the two alone (the GEMM then reads a fixed input). Returns the outputs."""
    from kernels import linear as skinny
    from kernels.paged_attention import l2_head
    from kernels.paged_attention import triton as kt

    _, mode, fraction = hint
    a_fixed = torch.randn((NEW, inp["w"][0].shape[1]), device=inp["q"].device, dtype=torch.bfloat16) * 0.1

    def body():
        outs = []
        for (k, v), w in zip(inp["kv"], inp["w"]):
            a = a_fixed
            if parts != "gemm":
                a, _ = kt.paged_prefill_packed(inp["q"], inp["q_pos"], k, v, inp["slot_pos"], inp["packed"],
                                               inp["cu_q"], inp["inv"], inp["scale"], key_hi=inp["key_hi"],
                                               l2_prefetch=l2_head(w, fraction) if mode else None)
                a = a.reshape(NEW, -1)
            if parts == "attention":
                outs.append(a)
            elif gemm == "skinny" and skinny.supported(a, w):
                outs.append(skinny.linear(a, w, backend="triton"))
            else:
                outs.append(F.linear(a, w))
        return outs
    return body


def _capture(body, mode: str | None):
    """(graph, its outputs, the eager outputs) of body with the short attention's l2_mode set to mode (read when
    the launch is made, so it is frozen into the graph)."""
    import dataclasses

    from kernels.paged_attention import triton as kt

    base = kt.SHORT_PREFILL
    kt.SHORT_PREFILL = dataclasses.replace(base, l2_mode=mode or base.l2_mode)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()
            eager = [o.clone() for o in body()]
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = body()
    finally:
        kt.SHORT_PREFILL = base
    graph.replay()
    torch.cuda.synchronize()
    return graph, outs, eager


def attention_bench(args) -> int:
    """Every variant's graph captured and checked first (outputs equal to the eager run and to the variant without
    the prefetch, bit for bit), then timed in rounds, the variants' order rotated each round; medians."""
    import statistics

    import kernels.pdl
    from kernels.paged_attention import triton as kt

    kernels.pdl.ENABLED = args.pdl
    dev = torch.device("cuda")
    n = args.layers
    t0 = time.perf_counter()
    inp = attention_inputs(n, dev)
    graphs, checks = {}, {}
    plan = [(f"{gemm}/{h[0]}", h, gemm, "both") for gemm in ("skinny", "cublas") for h in HINTS]
    plan += [(f"attention_only/{h[0]}", h, "skinny", "attention") for h in HINTS[:2]]
    plan += [(f"gemm_only/{gemm}", HINTS[0], gemm, "gemm") for gemm in ("skinny", "cublas")]
    for name, hint, gemm, parts in plan:
        graph, outs, eager = _capture(_layers(inp, hint, gemm, parts), hint[1])
        graphs[name] = graph
        ref = checks.get(name.rsplit("/", 1)[0] + "/off", (None, None, outs))[2]  # the same body, no prefetch
        checks[name] = (all(torch.equal(o, r) for o, r in zip(outs, ref)),
                        all(torch.equal(o, e) for o, e in zip(outs, eager)), outs)
        print(f"captured {name}: outputs {'equal to' if checks[name][0] else 'DIFFER from'} the variant without "
              f"the prefetch, graph {'equal to' if checks[name][1] else 'DIFFERS from'} eager  "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
    names = list(graphs)
    samples = {k: [] for k in names}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(args.rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            graphs[k].replay()  # one untimed replay: the variant before it leaves nothing of this one's in L2
            start.record()
            for _ in range(args.reps):
                graphs[k].replay()
            end.record()
            end.synchronize()
            samples[k].append(start.elapsed_time(end) / args.reps / n * 1e3)  # us a layer
    us = {k: statistics.median(v) for k, v in samples.items()}
    for k in names:
        base = us.get(k.rsplit("/", 1)[0] + "/off")
        delta = f"  {us[k] - base:+6.2f} vs off" if base is not None and not k.endswith("/off") else ""
        print(f"{k:28s} {us[k]:7.2f} us a layer{delta}  (spread {min(samples[k]):.2f}-{max(samples[k]):.2f})"
              f"{'' if checks[k][0] else '  OUTPUTS DIFFER'}")
    ok = all(c[0] for c in checks.values())
    print(f"outputs {'all equal' if ok else 'DIFFER'}; {time.perf_counter() - t0:.1f} s", flush=True)
    if args.out:
        rec = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "layers": n, "pdl": args.pdl,
               "rounds": args.rounds, "reps": args.reps, "short_prefill": repr(kt.SHORT_PREFILL),
               "hints": {h[0]: {"l2_mode": h[1], "fraction": h[2]} for h in HINTS}, "us_per_layer": us,
               "samples_us": samples, "outputs_equal_to_off": {k: c[0] for k, c in checks.items()},
               "graph_equal_to_eager": {k: c[1] for k, c in checks.items()}}
        Path(args.out).write_text(json.dumps(rec, indent=2))
    return 0 if ok else 1


def compile_report(args) -> int:
    """No GPU: the engine's short attention launch (SHORT_PREFILL, 8 KV splits: the entry plan's searches, fp32
    partials; Llama-3-8B heads, block size 16) compiled for sm_90 without the prefetch and with each mode, with
    and without PDL. Fails unless each prefetch build's PTX holds its instruction (and the build without none),
    its other instructions are those of the build without in the same order (the prefetch prologue inserted, at
    most a few instructions it shares dropped), and with PDL the prefetch comes before griddepcontrol.wait."""
    import difflib
    import re

    sys.path.insert(0, str(REPO / "tests" / "kernels"))
    from compile_sm90 import compile_kernel, constexpr_names, resources  # (sets TRITON_INTERPRET=0)

    from kernels.paged_attention import _prefill
    from kernels.paged_attention import triton as kt

    cfg = kt.SHORT_PREFILL or _prefill.PrefillConfig()
    fn = _prefill._prefill_kernel
    known = dict(G=4, G_PAD=4, BLOCK_T=cfg.block_m // 4, BS=BS, NB=max(1, cfg.min_block_n // BS), D=128, B_PAD=2,
                 ROTATE=True, USE_TABLE=True, MASK_IN_WORD=True, DOT_F32=False, SEARCH=True, EPS=cfg.prefetch_entries,
                 LINES=2, LINE=64, PF_LANES=32 * cfg.num_warps, PF_STEP=_prefill.L2_LINE)
    ptrs = dict(q_ptr="bf16", k_ptr="bf16", v_ptr="bf16", meta_ptr="i64", mask_ptr="i64", tab_ptr="fp32",
                invf_ptr="fp32", hi_ptr="i32", out_ptr="fp32", lse_ptr="fp32", fin_ptr="fp32", fin_lse_ptr="fp32",
                cnt_ptr="i64", pf_ptr="u8")
    ops = {"bulk": "cp.async.bulk.prefetch.L2.global", "lines": "prefetch.global.L2"}

    def opcodes(ptx: str) -> list[str]:
        """The kernel body's instructions (no labels, predicates, debug sections, nor the argument loads, which
        move with the new arguments), first token each."""
        out = []
        for line in ptx.split(".section")[0].splitlines():
            toks = [t for t in line.split() if not t.startswith("@")]
            if toks and not toks[0].endswith(":") and not toks[0].startswith(("//", ".", "{", "}", "ld.param")):
                out.append(toks[0])
        return out

    rows, failed = [], 0
    for pdl in (False, True):
        base = None
        for mode in (None, "bulk", "lines"):
            consts = {a: known.get(a, getattr(cfg, a.lower(), False)) for a in constexpr_names(fn)}
            consts.update(PDL=pdl, PF_L2=mode is not None, PF_BULK=mode == "bulk",
                          PF_STEP=cfg.l2_bulk_bytes if mode == "bulk" else _prefill.L2_LINE)
            kern = compile_kernel(fn, {a: ptrs.get(a, "i32") for a in fn.arg_names if a.endswith("_ptr")}, consts,
                                  dict(qk_scale="fp32"), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            ptx = kern.asm["ptx"]
            name = f"{mode or 'off'}{'-pdl' if pdl else ''}"
            row = {"variant": name, "resources": resources(kern.asm["cubin"]),
                   **{f"{m}_in_ptx": len(re.findall(re.escape(op) + r"\s", ptx)) for m, op in ops.items()}}
            problems = [f"{m} prefetch {'missing from' if m == mode else 'in'} the PTX" for m in ops
                        if (row[f"{m}_in_ptx"] > 0) != (m == mode)]
            body = opcodes(ptx)
            if base is None:
                base = body
            else:
                sm = difflib.SequenceMatcher(None, base, body, autojunk=False)
                kept = sum(b.size for b in sm.get_matching_blocks())
                row.update(instructions=len(body), without_prefetch=len(base), kept=kept, added=len(body) - kept)
                if kept < len(base) - 4:
                    problems.append(f"only {kept} of the {len(base)} instructions without the prefetch kept in order")
            if pdl:
                wait = ptx.find("griddepcontrol.wait")
                at = ptx.find(ops[mode]) if mode else -1
                row["prefetch_before_wait"] = mode is not None and 0 <= at < wait
                if wait < 0 or (mode and not row["prefetch_before_wait"]):
                    problems.append("the prefetch does not precede griddepcontrol.wait")
            row["problems"] = problems
            failed += bool(problems)
            rows.append(row)
            print(f"{name:10s} {row['resources']}  bulk x{row['bulk_in_ptx']} lines x{row['lines_in_ptx']}"
                  + (f"  {row['kept']}/{row['without_prefetch']} instructions kept, {row['added']} added"
                     if "kept" in row else "") + ("  " + "; ".join(problems) if problems else "  ok"), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"triton": triton.__version__, "config": repr(cfg), "compile": rows},
                                             indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
