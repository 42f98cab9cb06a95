"""What each non-GEMM kernel of the ratio-0 layer costs inside the 32-layer chain (issue #2's `tessera@0`).

bench/pdl_stack/pdl_stack.py --chain times the engine's 9 launches a layer at 64 rows as one CUDA graph. This times the same
chain with kernels left out, each variant captured with PDL on (KernelOptions' default) and timed alternately, so the
difference to the whole chain is what a fusion that removed those launches could save at most (the outputs of a
chain with kernels left out are not the layer's: nothing here is checked but the timing):

  all         the 9 launches
  -norms      no rms_norm / add_rms_norm (the GEMMs read the hidden state as it is)
  -qkv_heads  no RoPE / KV write launch (attention reads q straight from the q|k|v output)
  -attention  no attention and no LSE merge (o reads q as its input)
  gemms       the four GEMMs alone
  -gemms      everything but the GEMMs (each GEMM's output a buffer written once, before the graph)
  +pf_o       all 9, and a tenth launch after qkv_heads that asks L2 for the o weight (PTX
              cp.async.bulk.prefetch.L2, 4 KB a request, before its griddepcontrol.wait: a PDL launch that
              starts while qkv_heads runs), so the o GEMM may read it from L2 after the attention
  +pf_o_half  the same for the o weight's first half

    python3 bench/pdl_stack/chain_drop.py [--layers 32] [--rounds 5] [--out DIR/chain_drop.json]
    python3 bench/pdl_stack/chain_drop.py --configs [--out DIR/chain_configs.json]

``--configs``: the whole chain with one GEMM's 64-row table entry (kernels/linear/config.py, CONFIGS) replaced at a
time by each of CANDIDATES (TMA configs; gate|up's fused launch halves its block_n), timed alternately with the
table's own; the outputs' largest difference to the table's is recorded (another tile can sum in another order).
The table was picked GEMM by GEMM, alone; inside the chain, with PDL, the next kernel's programs share the SMs.

Outcome (H100, 2026-11-22; bench/pdl_stack/: 2026-11-22_h100_4a18120_drop.json, _a5b191d_drop_prefetch.json,
_da53419_drop_configs.json; bench/pdl_stack/README.md):
all 6.22-6.23 ms; -norms 6.08-6.10; -qkv_heads 6.17-6.18; -attention 5.26; gemms 5.07; -gemms 1.04; +pf_o 6.53 and
+pf_o_half 6.41 (slower, the same bits); every candidate GEMM tile slower than the table's (by 0.006-0.711 ms).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pdl_stack  # noqa: E402
from kernels.pdl import enter as pdl_enter  # noqa: E402
from pdl_stack import EPS, _graph_ms, chain_inputs, kt  # noqa: E402

# (N, K) of each projection -> TMA configs (block_m, block_n, block_k, stages) tried in its 64-row entry
CANDIDATES = {
    (6144, 4096): ((64, 32, 128, 6), (64, 64, 256, 3), (64, 128, 128, 3), (64, 64, 64, 8)),
    (4096, 4096): ((64, 32, 128, 6), (64, 64, 128, 4), (64, 16, 256, 5), (64, 32, 64, 8)),
    (28672, 4096): ((64, 128, 128, 3), (64, 32, 128, 5), (64, 64, 64, 6), (64, 64, 256, 2)),
    (4096, 14336): ((64, 32, 256, 4), (64, 64, 128, 4), (64, 16, 128, 8), (64, 32, 64, 8)),
}
VARIANTS = {"all": set(), "-norms": {"norms"}, "-qkv_heads": {"qkv_heads"}, "-attention": {"attention"},
            "gemms": {"norms", "qkv_heads", "attention"}, "-gemms": {"gemms"}, "+pf_o": {"+pf_o"},
            "+pf_o_half": {"+pf_o_half"}}
_BULK = tl.constexpr("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $2, 0;\n\t@p cp.async.bulk.prefetch.L2.global [$1], $3;"
                     "\n\tmov.u32 $0, 0;\n\t}")


@triton.jit
def _prefetch_kernel(ptr, n_bytes, STEP: tl.constexpr, LANES: tl.constexpr, PDL: tl.constexpr = False):
    """Ask L2 for bytes [0, n_bytes) of ptr, STEP bytes a lane, then (PDL) wait for the kernel before."""
    pid = tl.program_id(0)
    lanes = tl.arange(0, LANES)
    for base in range(pid * LANES * STEP, n_bytes, tl.num_programs(0) * LANES * STEP):
        off = base + lanes * STEP
        ok = off < n_bytes
        size = tl.minimum(n_bytes - off, STEP).to(tl.int32)
        tl.inline_asm_elementwise(_BULK, "=r,l,r,r", [ptr + off, ok.to(tl.int32), size], dtype=tl.int32,
                                  is_pure=False, pack=1)
    pdl_enter(PDL)


def l2_prefetch(w: torch.Tensor, fraction: float, programs: int = 16, step: int = 4096, lanes: int = 128) -> None:
    from kernels import pdl

    n_bytes = int(w.numel() * w.element_size() * fraction) // 128 * 128
    _prefetch_kernel[(programs,)](w.view(-1).view(torch.uint8), n_bytes, STEP=step, LANES=lanes,
                                  **pdl.launch_kwargs(w.device))


def chain(inp: dict, drop: set, outs: dict) -> torch.Tensor:
    """pdl_stack.chain_forward with the launches named in ``drop`` left out (``outs``: each GEMM's stand-in
    output by weight name, for drop={"gemms"})."""
    from kernels.fused import KVWrite
    from kernels.fused import triton as kf
    from kernels.paged_attention import triton as pat

    sh, t = inp["shape"], inp["t"]
    hq, d = sh["hq"], sh["d"]
    key_hi = pat.prefill_key_bounds(inp["packed"], inp["slot_pos"])
    h = inp["h0"]

    def gemm(x, w, name, **kw):
        if "gemms" in drop:
            return outs[name]
        return kt.linear(x, w, **kw)

    for lw in inp["layers"]:
        x = h if "norms" in drop else kf.rms_norm(h, lw["in_norm"], EPS)
        qkv = gemm(x, lw["wqkv"], "wqkv")
        if "qkv_heads" in drop:
            q = qkv[:, :hq * d].view(t, hq, d)
        else:
            q, _, _ = kf.qkv_heads(qkv, hq, sh["hkv"], cos=inp["cos"], sin=inp["sin"], return_kv=False,
                                   write=KVWrite(lw["k"], lw["v"], inp["write_block"], inp["write_slot"]))
        if "+pf_o" in drop or "+pf_o_half" in drop:
            l2_prefetch(lw["wo"], 1.0 if "+pf_o" in drop else 0.5)
        if "attention" in drop:
            a = qkv[:, :hq * d]  # (a view: no copy launched)
        else:
            a, _ = pat.paged_prefill_packed(q, inp["q_pos"], lw["k"], lw["v"], inp["slot_pos"], inp["packed"],
                                            inp["cu_q"], inp["inv"], d ** -0.5, key_hi=key_hi)
            a = a.reshape(t, hq * d)
        o = gemm(a, lw["wo"], "wo")
        if "norms" in drop:
            x = o
        else:
            x, h = kf.add_rms_norm(o, h, lw["post_norm"], EPS)
        if "gemms" in drop:
            act = outs["wgu"]
            h = outs["wd"]
        else:
            act = kt.linear_swiglu(x, lw["wgu"])
            h = kt.linear(act, lw["wd"], accumulate=h)
    return h


def configs(inp: dict, outs: dict, rounds: int, reps: int) -> dict:
    """--configs: the chain under each candidate entry, alternately with the table's (see the module docstring)."""
    from kernels.linear import config as lc

    table = dict(lc.CONFIGS)

    def entry(shape, cfg):  # the table's rows for (N, K) with the 64-row one replaced
        return tuple((m, cfg if m == 64 else c) for m, c in table[shape])

    variants = {"table": None}
    for shape, cands in CANDIDATES.items():
        for bm, bn, bk, st in cands:
            variants[f"{shape[0]}x{shape[1]} m{bm} n{bn} k{bk} st{st}"] = (shape, lc._TMA(bm, bn, bk, st))
    graphs, rec, ref = {}, {}, None
    for name, change in variants.items():
        try:
            if change is not None:
                lc.CONFIGS[change[0]] = entry(*change)
            out = chain(inp, set(), outs)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = chain(inp, set(), outs)
            graph.replay()
            torch.cuda.synchronize()
        except Exception as exc:  # a config the device cannot take: report it, go on
            rec[name] = {"error": repr(exc)[:400]}
            print(f"{name}: FAILED {exc!r}"[:400], flush=True)
            continue
        finally:
            lc.CONFIGS.clear()
            lc.CONFIGS.update(table)
        ref = out.clone() if ref is None else ref
        graphs[name] = graph
        rec[name] = {"ms": [], "max_abs_diff_vs_table": float((out.float() - ref.float()).abs().max())}
    for r in range(rounds):
        for name, graph in graphs.items():
            rec[name]["ms"].append(_graph_ms(graph, reps))
    base = min(rec["table"]["ms"])
    for name, row in rec.items():
        if "ms" in row:
            row["best_ms"] = min(row["ms"])
            print(f"{name:36s} {row['best_ms']:7.3f} ms ({base - row['best_ms']:+.3f} against the table)  "
                  f"max |diff| {row['max_abs_diff_vs_table']:.3g}", flush=True)
    return rec


def main() -> int:
    from kernels import pdl

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", action="store_true", help="the GEMM table's 64-row entries against candidates")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    dev = torch.device("cuda")
    shape = pdl_stack.CHAIN_SHAPES["llama3-8b"]
    inp = chain_inputs(shape, args.layers, dev, torch.bfloat16)
    t, lw0 = inp["t"], inp["layers"][0]
    outs = {name: torch.randn(t, lw0[name].shape[0] // (2 if name == "wgu" else 1), device=dev,
                              dtype=torch.bfloat16) for name in ("wqkv", "wo", "wgu", "wd")}
    rec = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "pdl": pdl.active(dev),
           "gemm_pdl_steps": kt.pdl_steps(dev), "variants": {}}
    if args.configs:
        rec["configs"] = configs(inp, outs, args.rounds, args.reps)
        return _write(args.out, rec)
    graphs, results = {}, {}
    for name, drop in VARIANTS.items():
        chain(inp, drop, outs)  # compiles
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(inp, drop, outs)
        graph.replay()
        torch.cuda.synchronize()
        results[name] = out.clone()
        graphs[name] = graph
        rec["variants"][name] = {"dropped": sorted(drop), "ms": []}
    # the prefetch variants change no value: the same bits as the whole chain (the others are not the layer)
    rec["same_bits_as_all"] = {n: torch.equal(results["all"], results[n]) for n in ("+pf_o", "+pf_o_half")}
    print(f"prefetch variants equal to all bit for bit: {rec['same_bits_as_all']}", flush=True)
    for r in range(args.rounds):
        for name, graph in graphs.items():
            ms = _graph_ms(graph, args.reps)
            rec["variants"][name]["ms"].append(ms)
            print(f"round {r + 1}: {name:11s} {ms:7.3f} ms", flush=True)
    best = {n: min(v["ms"]) for n, v in rec["variants"].items()}
    rec["best_ms"] = best
    for name, ms in best.items():
        print(f"{name:11s} {ms:7.3f} ms  ({best['all'] - ms:+.3f} ms against all, "
              f"{(best['all'] - ms) / args.layers * 1e3:+.1f} us a layer)", flush=True)
    return _write(args.out, rec)


def _write(out: str | None, rec: dict) -> int:
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(rec, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
