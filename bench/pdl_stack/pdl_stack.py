"""Programmatic dependent launch for the skinny GEMMs: does a layer stack get faster? (issue #2's ratio-0 pass)

A short pass is a chain of kernels, each reading its weights once; between two of them the GPU drains
(the last programs of one kernel finish while SMs idle) and refills. With a programmatic dependent launch
(PDL) a kernel's programs start while the kernel before it finishes: they ask L2 for their first weight
rows, wait for it (griddepcontrol.wait), then run. This times, as one CUDA graph over 32 layers of distinct
Llama-3-8B weights (bf16), the projection chain h -> q|k|v -> o -> gate|up with SiLU*up -> down (+= h),
every launch through kernels/linear's Triton kernel, without PDL and with it (0, 2 or 4 prefetched steps),
and checks that every variant gives the same bits.

    python3 bench/pdl_stack/pdl_stack.py [--out DIR/pdl_stack.json] [--rows 64,8]
    python3 bench/pdl_stack/pdl_stack.py --chain [--layers 32] [--out DIR/pdl_chain.json]
    TRITON_INTERPRET=1 python3 bench/pdl_stack/pdl_stack.py --chain --tiny        # the same chain on the CPU, untimed

``--chain``: a 64-token suffix's whole decoder layer (bench/pdl_stack/README.md): the 9 Triton kernels the engine runs
per layer at 64 rows (rms_norm, q|k|v GEMM, qkv_heads writing the KV cache, the paged prefill attention over 6 x
512 cached keys with KV splits, the LSE merge, o GEMM, add_rms_norm, gate|up SwiGLU GEMM, down GEMM onto the
residual) over --layers layers of distinct weights and caches, captured as one CUDA graph two ways: no PDL
("off", KernelOptions(pdl=False)) and the default ("pdl"); timed alternately --rounds times; the outputs (hidden state and every layer's written KV rows) checked equal to
off's bit for bit.

Outcome (H100, 2026-11-22, bench/pdl_stack/2026-11-22_h100_2fad6bf_projections.json): 64 rows 5.298 ms without PDL, 5.210 / 5.131 / 5.147 ms with it
(0 / 2 / 4 steps prefetched); 8 rows 5.082 ms without, 5.090 / 5.205 / 5.652 with. In the engine, where the kernels
before most projections (norms, attention, cuBLAS) do not take part, no change beyond the spread (bench/HISTORY.md,
2026-11-22). The GEMMs launch with PDL (2 steps, kernels/linear/triton.py's PDL_PREFETCH_STEPS) while
KernelOptions.pdl is on.

--chain (H100, 2026-11-22, bench/pdl_stack/2026-11-22_h100_39c36a1_chain.json): off 6.562, gemm 6.623, pdl 6.441, early 6.448, early+8 6.578 ms,
every variant the same bits: PDL stays on; the GEMMs-alone and "early" variants were removed with the code that
made them (bench/pdl_stack/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402

from kernels.linear import triton as kt  # noqa: E402
from kernels.linear.config import LinearConfig  # noqa: E402
from kernels.options import KernelOptions, using  # noqa: E402

HIDDEN, QKV, INTER = 4096, 6144, 14336


def configs(m: int) -> dict[str, LinearConfig]:
    """The sweep's fastest Triton configs per projection at m rows (bench/skinny_gemm/README.md)."""
    if m <= 8:
        return {"qkv": LinearConfig(16, 64, 256, num_stages=3), "o": LinearConfig(16, 32, 128, num_stages=5),
                "down": LinearConfig(16, 32, 256, num_stages=5)}
    return {"qkv": LinearConfig(64, 64, 128, num_stages=5), "o": LinearConfig(64, 32, 128, num_stages=5),
            "down": LinearConfig(64, 32, 256, num_stages=4)}


def main() -> int:
    if "--chain" in sys.argv:  # every kernel of the layer behind kernels/pdl.py's switch
        return chain_main([a for a in sys.argv[1:] if a != "--chain"])
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


# ---- --chain: the whole layer behind kernels/pdl.py's switch ----

CHAIN_SHAPES = {  # Llama-3-8B (issue #2's tessera@0 pass), and a tiny one for the CPU interpreter
    "llama3-8b": dict(hidden=4096, inter=14336, hq=32, hkv=8, d=128, chunks=6, chunk=512, suffix=64, theta=500000.0),
    "tiny": dict(hidden=256, inter=512, hq=4, hkv=2, d=64, chunks=3, chunk=256, suffix=8, theta=10000.0),  # 2 KV splits
}
BLOCK_SIZE, EPS = 16, 1e-5


def chain_inputs(shape: dict, layers: int, dev, dtype, seed: int = 0) -> dict:
    """Weights and KV caches of ``layers`` layers and one request's static inputs: ``chunks`` cached chunks of
    ``chunk`` tokens each placed at its offset (keys at local positions, deferred RoPE), then ``suffix`` new
    tokens in private blocks (offset 0, slot positions global) that qkv_heads writes; the packed table."""
    from kernels.paged_attention import triton as pat
    from kernels.rope import rope_inv_freq

    g = torch.Generator(device=dev).manual_seed(seed)
    h, inter, hq, hkv, d = shape["hidden"], shape["inter"], shape["hq"], shape["hkv"], shape["d"]
    bs, t, ctx = BLOCK_SIZE, shape["suffix"], shape["chunks"] * shape["chunk"]
    if shape["chunk"] % bs:
        raise ValueError(f"chunk length {shape['chunk']} must be a multiple of the block size {bs}")

    def rand(*size, scale=1.0):
        return (torch.randn(*size, device=dev, dtype=torch.float32, generator=g) * scale).to(dtype)

    n_chunk_blocks, n_suffix_blocks = ctx // bs, -(-t // bs)
    n_blocks = n_chunk_blocks + n_suffix_blocks
    per_chunk = shape["chunk"] // bs
    idx = torch.arange(n_blocks, device=dev)
    offsets = torch.where(idx < n_chunk_blocks, (idx // per_chunk) * shape["chunk"], 0).to(torch.int32)
    s = torch.arange(bs, device=dev)
    slot_pos = torch.where((idx < n_chunk_blocks)[:, None], (idx % per_chunk)[:, None] * bs + s,
                           ctx + (idx - n_chunk_blocks)[:, None] * bs + s).to(torch.int32)
    visible = torch.where(idx < n_chunk_blocks, bs, (t - (idx - n_chunk_blocks) * bs).clamp(0, bs))
    masks = ((1 << visible) - 1).to(torch.int64)  # the suffix's last block: only its written slots
    inv = rope_inv_freq(d, shape["theta"]).to(device=dev, dtype=torch.float32)
    cu_e = torch.tensor([0, n_blocks], dtype=torch.int32, device=dev)
    packed = pat.pack(idx.to(torch.int32), offsets, masks, bs, inv, with_table=True,
                      cu_entries=cu_e)
    pos = torch.arange(ctx, ctx + t, device=dev)
    ang = pos.float()[:, None] * inv[None, :]
    tok = torch.arange(t, device=dev)
    return dict(
        shape=shape, t=t, packed=packed, slot_pos=slot_pos, inv=inv, q_pos=pos.to(torch.int32),
        cu_q=torch.tensor([0, t], dtype=torch.int32, device=dev), cos=ang.cos()[:, None], sin=ang.sin()[:, None],
        write_block=(n_chunk_blocks + tok // bs).long(), write_slot=(tok % bs).long(), first_suffix_block=n_chunk_blocks,
        h0=rand(t, h),
        layers=[dict(in_norm=1 + rand(h, scale=0.1), wqkv=rand((hq + 2 * hkv) * d, h, scale=h ** -0.5),
                     wo=rand(h, hq * d, scale=(hq * d) ** -0.5), post_norm=1 + rand(h, scale=0.1),
                     wgu=rand(2 * inter, h, scale=h ** -0.5), wd=rand(h, inter, scale=inter ** -0.5),
                     k=rand(n_blocks, bs, hkv, d), v=rand(n_blocks, bs, hkv, d)) for _ in range(layers)])


def chain_forward(inp: dict) -> torch.Tensor:
    """The pass: the key bounds once, then per layer the engine's 9 launches at 64 rows (services/engine/model/layers.py
    with the skinny GEMM, norms not in the GEMMs, fused gate|up). Returns the final hidden state [T, H]."""
    from kernels.fused import KVWrite
    from kernels.fused import triton as kf
    from kernels.paged_attention import triton as pat

    sh, t = inp["shape"], inp["t"]
    key_hi = pat.prefill_key_bounds(inp["packed"], inp["slot_pos"])
    h = inp["h0"]
    for lw in inp["layers"]:
        x = kf.rms_norm(h, lw["in_norm"], EPS)
        qkv = kt.linear(x, lw["wqkv"])
        q, _, _ = kf.qkv_heads(qkv, sh["hq"], sh["hkv"], cos=inp["cos"], sin=inp["sin"], return_kv=False,
                               write=KVWrite(lw["k"], lw["v"], inp["write_block"], inp["write_slot"]))
        a, _ = pat.paged_prefill_packed(q, inp["q_pos"], lw["k"], lw["v"], inp["slot_pos"], inp["packed"], inp["cu_q"],
                                        inp["inv"], sh["d"] ** -0.5, key_hi=key_hi)
        o = kt.linear(a.reshape(t, sh["hq"] * sh["d"]), lw["wo"])
        x, h = kf.add_rms_norm(o, h, lw["post_norm"], EPS)
        act = kt.linear_swiglu(x, lw["wgu"])
        h = kt.linear(act, lw["wd"], accumulate=h)  # h is add_rms_norm's fresh output: added in place
    return h


def _graph_ms(graph, reps: int) -> float:
    """Median of ``reps`` timed replays (CUDA events around each), after 3 untimed ones."""
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _kernel_count(inp: dict) -> dict:
    """Kernels one eager pass launches (torch profiler), by name: the chain should be 9 a layer and the key
    bounds once, nothing else."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        chain_forward(inp)
        torch.cuda.synchronize()
    names = Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return {"total": sum(names.values()), "by_name": dict(names.most_common())}


# (name, the kernel options its graph is captured under), in timing order
VARIANTS = (("off", KernelOptions(pdl=False)), ("pdl", KernelOptions()))


def chain_main(argv: list[str]) -> int:
    from kernels import pdl

    ap = argparse.ArgumentParser(description="the whole layer chain with KernelOptions.pdl off and on")
    ap.add_argument("--out")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5, help="the variants timed alternately this many times")
    ap.add_argument("--reps", type=int, default=50, help="timed replays per timing")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (2 layers unless --layers): the CPU check")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("no CUDA device: run with TRITON_INTERPRET=1 (and --tiny) to check the chain on the CPU")
    dev = torch.device("cuda" if cuda else "cpu")
    shape = CHAIN_SHAPES["tiny" if args.tiny else "llama3-8b"]
    layers = args.layers if not args.tiny or "--layers" in argv else 2
    inp = chain_inputs(shape, layers, dev, torch.bfloat16)
    rec = {"device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter, untimed)",
           "torch": torch.__version__, "triton": triton.__version__, "shape": shape, "layers": layers,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "variants": {}}
    graphs, results = {}, {}
    s = inp["first_suffix_block"]

    def snapshot(out):  # the hidden state and every layer's written KV rows
        return [out.clone()] + [x[s:].clone() for lw in inp["layers"] for x in (lw["k"], lw["v"])]

    for name, options in VARIANTS:
        with using(options):
            try:
                active = pdl.active(dev)
                steps = kt.pdl_steps(dev) if cuda else -1  # what the GEMMs launch with (the interpreter: no PDL)
                out = chain_forward(inp)  # eager: compiles every variant
                if cuda:
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        out = chain_forward(inp)
                    graph.replay()
                    torch.cuda.synchronize()
                    graphs[name] = (graph, out)
            except Exception as exc:  # report what failed, and stop: there is nothing to compare
                rec["variants"][name] = {"error": repr(exc)[:1000]}
                print(f"{name}: FAILED {exc!r}"[:1000], flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps(rec, indent=2))
                return 1
        results[name] = snapshot(out)
        rec["variants"][name] = {"layer_pdl": active, "gemm_pdl_steps": steps, "ms": []}
        print(f"{name}: {'captured' if cuda else 'ran'} (whole-layer PDL: {active}, GEMM PDL prefetch steps: "
              f"{steps if steps >= 0 else 'off'})", flush=True)

    def equal(snaps):
        return {n: all(torch.equal(a, b) for a, b in zip(snaps["off"], snaps[n])) for n in snaps if n != "off"}

    rec["same_bits"] = equal(results)
    same = all(rec["same_bits"].values())
    rec["finite"] = bool(torch.isfinite(results["off"][0].float()).all())
    print(f"outputs (hidden state and the written KV rows) equal to off's bit for bit: {rec['same_bits']}; "
          f"finite: {rec['finite']}", flush=True)
    if cuda:
        try:
            rec["kernels_per_pass"] = _kernel_count(inp)  # (with PDL on: what the "pdl" graph holds)
            print(f"kernels in one pass: {rec['kernels_per_pass']['total']}", flush=True)
        except Exception as exc:  # the count is a check, not the measurement: go on
            rec["kernels_per_pass"] = {"error": repr(exc)[:400]}
        for r in range(args.rounds):
            for name, (graph, _) in graphs.items():
                ms = _graph_ms(graph, args.reps)
                rec["variants"][name]["ms"].append(ms)
                print(f"round {r + 1}: {name:4s} {ms:7.3f} ms", flush=True)
        best = {n: min(v["ms"]) for n, v in rec["variants"].items()}
        rec["best_ms"] = best
        print(f"best of {args.rounds}: " + ", ".join(f"{n} {ms:.3f} ms ({best['off'] - ms:+.3f} saved)"
                                                  for n, ms in best.items()), flush=True)
        again = {}
        for name, (graph, out) in graphs.items():  # the graphs' own outputs, after every timed replay
            graph.replay()
            torch.cuda.synchronize()
            again[name] = snapshot(out)
        rec["same_bits_after_timing"] = equal(again)
        same = same and all(rec["same_bits_after_timing"].values())
        print(f"graph outputs after timing equal to off's bit for bit: {rec['same_bits_after_timing']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rec, indent=2))
    return 0 if same and rec["finite"] else 1


if __name__ == "__main__":
    sys.exit(main())
