"""Engine benchmark (GPU): prefill latency of every mode beside transformers' full prefill.

Llama-3-8B-shaped model with random weights, bf16, 6 chunks x 512 tokens + a 64-token suffix, all
chunks resident (each mode is warmed once so its cache holds them). Peer in the same run:
transformers full prefill with SDPA (logits for the last position only). Times are medians of CUDA-
synchronised wall clock over repeated calls.

Rows per attention backend: ``<backend>`` = the engine's default on CUDA, short passes replayed as
CUDA-graph static tails (graphs.py; attention through that backend: SDPA for torch, the deferred-RoPE
paged kernel for triton); ``<backend>-eager`` = the same engine with static tails off.

    python3 bench/engine/engine.py --out bench/engine/engine.json [--backends torch,triton] [--graphs on,off] [--layers 32]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels.options import KernelOptions  # noqa: E402
from services.engine import Engine, ModelConfig  # noqa: E402
from services.engine.options import EngineOptions  # noqa: E402

# the option sets a backend may name after a colon (triton:nopdl): each the default with one measured winner off,
# the peer of an A/B in one process (bench/engine/README.md)
VARIANTS = {
    "": EngineOptions(),
    "cublas": EngineOptions(skinny_gemm=False),             # every projection on cuBLAS
    "nopdl": EngineOptions(kernels=KernelOptions(pdl=False)),  # no programmatic dependent launch
    "notma": EngineOptions(kernels=KernelOptions(tma=False)),  # the skinny GEMM by pointer loads only
    "generaltail": EngineOptions(reuse_graph=False),         # ratio-0 passes through the general static tail
    "generalblend": EngineOptions(blend_graph=False),        # CacheBlend passes through the general path
}

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
    rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192})


def timed(fn, warmup=2, reps=8):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def count_syncs(fn) -> tuple[int, list[str]]:
    """Host-device synchronisations during fn() (torch's sync debug mode: .item(), nonzero, copies from
    pageable host memory, ...) and the first few places they came from."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    return len(syncs), sorted({f"{Path(w.filename).name}:{w.lineno}" for w in syncs})[:40]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/engine/engine.json")
    ap.add_argument("--backends", default="torch,triton",
                    help="attention backends, each optionally with one of the named option sets of VARIANTS after a "
                         f"colon (torch,triton,triton:nopdl); the sets: {', '.join(sorted(VARIANTS))}")
    ap.add_argument("--graphs", default="on,off", help="static tails (CUDA graphs) on, off, or both")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--chunks", type=int, default=6)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--suffix-tokens", type=int, default=64)
    ap.add_argument("--profile", action="store_true",
                    help="print (and keep in the JSON) a torch profile of each --profile-modes pass per backend")
    ap.add_argument("--profile-modes", default="tessera@0.0,tessera@0.15", help="the passes --profile profiles")
    ap.add_argument("--miss", action="store_true",
                    help="also time each reuse mode with chunks it has never seen (a miss row per mode: every chunk "
                         "computed alone, then the pass), new random chunks for every call")
    ap.add_argument("--modes", default="full@0.0,prefix@0.0,position_aware@0.0,blend_copy@0.15,tessera@0.15,"
                                       "tessera@0.0,tessera@0.3", help="rows to time, mode@ratio")
    args = ap.parse_args()
    import transformers

    hf_cfg = dict(LLAMA3_8B, num_hidden_layers=args.layers)
    config = transformers.LlamaConfig(**{k: v for k, v in hf_cfg.items() if k != "architectures"})
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    cfg = ModelConfig.from_hf_dict(hf_cfg)
    state = dict(hf.state_dict())
    g = torch.Generator().manual_seed(1)
    chunks = [torch.randint(0, 128000, (args.chunk_tokens,), generator=g).tolist() for _ in range(args.chunks)]
    suffix = torch.randint(0, 128000, (args.suffix_tokens,), generator=g).tolist()
    ids = torch.tensor([sum(chunks, []) + suffix], device="cuda")
    n_tokens = ids.shape[1]
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d"),
               "layers": args.layers, "tokens": n_tokens, "chunks": args.chunks, "chunk_tokens": args.chunk_tokens,
               "suffix_tokens": args.suffix_tokens, "rows": []}

    with torch.inference_mode():
        peer = timed(lambda: hf(ids, use_cache=True, logits_to_keep=1))
    results["peer_transformers_sdpa_full_s"] = peer
    print(f"peer transformers SDPA full prefill of {n_tokens} tokens: {peer * 1e3:.1f} ms", flush=True)

    rows = [(m, float(r)) for m, r in (item.split("@") for item in args.modes.split(","))]
    graphs = {"on": True, "off": False}
    logits = {}  # (backend, static, mode, ratio) -> logits: graph rows are checked against eager ones
    variants = [(b, graphs[g]) for b in args.backends.split(",") for g in args.graphs.split(",")]
    for backend, static in variants:
        label = backend + ("" if static else "-eager")
        backend, _, variant = backend.partition(":")
        eng = None  # the previous variant's engine (weights, KV pool, graphs) goes before the next is built
        gc.collect()
        torch.cuda.empty_cache()
        try:
            if variant not in VARIANTS:
                raise ValueError(f"unknown option set {variant!r}; one of {sorted(VARIANTS)}")
            eng = Engine.from_state_dict(cfg, state, device="cuda", dtype=torch.bfloat16, attention_backend=backend,
                                         kv_cache_bytes=12 << 30, static_tails=static, options=VARIANTS[variant])
        except Exception as exc:  # report and go on: one backend failing must not hide the others
            results["rows"].append({"backend": label, "error": repr(exc)})
            print(f"{label}: {exc!r}", flush=True)
            continue
        with torch.inference_mode():
            ref = hf(ids, use_cache=False, logits_to_keep=1).logits[0, -1].float()
        for mode, ratio in rows:
            try:
                first = eng.prefill(chunks, suffix, mode=mode, recompute_ratio=ratio)  # warms the cache
                s = timed(lambda: eng.prefill(chunks, suffix, mode=mode, recompute_ratio=ratio))
                r = eng.prefill(chunks, suffix, mode=mode, recompute_ratio=ratio)
            except Exception as exc:
                results["rows"].append({"backend": label, "mode": mode, "ratio": ratio, "error": repr(exc)[:2000]})
                print(f"{label} {mode}@{ratio}: {repr(exc)[:500]}", flush=True)
                continue
            try:
                n_syncs, sync_sites = count_syncs(lambda: eng.prefill(chunks, suffix, mode=mode, recompute_ratio=ratio))
            except Exception as exc:  # a diagnostic: never lose the row for it
                n_syncs, sync_sites = -1, [repr(exc)[:300]]
            # against the peer's full prefill: exact modes within bf16 rounding, reuse modes by their approximation too
            err = float((r.logits - ref).abs().max())
            tails = eng.forward.tails
            logits[(label.removesuffix("-eager"), static, mode, ratio)] = r.logits.float().cpu()
            miss = None
            if args.miss and mode not in ("full", "prefix"):
                fresh = iter([[torch.randint(0, 128000, (args.chunk_tokens,), generator=g).tolist()
                               for _ in range(args.chunks)] for _ in range(12)])
                miss = timed(lambda: eng.prefill(next(fresh), suffix, mode=mode, recompute_ratio=ratio))
                print(f"{label:14s} {mode:15s} r={ratio:<4} {miss * 1e3:8.1f} ms with every chunk new", flush=True)
            row = {"backend": label, "mode": mode, "ratio": ratio, "seconds": s, "vs_peer": peer / s,
                   "miss_seconds": miss,
                   "first_call_seconds": first.stats.total_seconds, "stats": r.stats.as_dict(),
                   "max_abs_logit_err_vs_peer": err, "graphs_captured": len(tails.tails) if tails else 0,
                   "host_syncs_per_pass": n_syncs, "host_sync_sites": sync_sites}
            results["rows"].append(row)
            print(f"{label:14s} {mode:15s} r={ratio:<4} {s * 1e3:8.1f} ms  ({peer / s:5.2f}x peer)"
                  + f"  {n_syncs:3d} syncs" + (f"  |dlogit|={err:.3g}" if err is not None else ""), flush=True)
        if args.profile and static:
            from torch.profiler import ProfilerActivity, profile

            for pmode, ratio in ((m, float(r)) for m, r in (i.split("@") for i in args.profile_modes.split(","))):
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    eng.prefill(chunks, suffix, mode=pmode, recompute_ratio=ratio)
                    torch.cuda.synchronize()
                by_gpu = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70)
                print(f"profile of {label} {pmode}@{ratio}, by GPU time:\n{by_gpu}", flush=True)
                results.setdefault("profiles", {})[f"{label} {pmode}@{ratio}"] = [
                    {"name": e.key, "calls": e.count, "gpu_us": e.self_device_time_total,
                     "cpu_us": e.self_cpu_time_total}
                    for e in sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:40]]
        mem = eng.describe_memory()
        per_chunk = -(-args.chunk_tokens // eng.block_size) * mem["block_bytes"]
        results.setdefault("memory", {})[label] = {
            **mem, "kv_bytes_per_resident_chunk": per_chunk,
            "private_kv_bytes_per_request": {
                f"{row['mode']}@{row['ratio']}": (row["stats"]["private_blocks_allocated"]) * mem["block_bytes"]
                for row in results["rows"] if row.get("backend") == label and "stats" in row}}
        del eng
        torch.cuda.empty_cache()
    for row in results["rows"]:
        backend = row["backend"].removesuffix("-eager")
        key = (backend, not row["backend"].endswith("-eager"), row.get("mode"), row.get("ratio"))
        twin = logits.get((backend, not key[1], key[2], key[3]))
        if key in logits and twin is not None:
            row["max_abs_logit_diff_graphs_vs_eager"] = float((logits[key] - twin).abs().max())
            print(f"{row['backend']:14s} {key[2]:15s} r={key[3]:<4} |dlogit| graphs vs eager "
                  f"{row['max_abs_logit_diff_graphs_vs_eager']:.3g}")
        skinny = logits.get((backend.partition(":")[0], key[1], key[2], key[3]))
        if ":" in backend and key in logits and skinny is not None:
            row["max_abs_logit_diff_vs_default_gemm"] = float((logits[key] - skinny).abs().max())
            print(f"{row['backend']:14s} {key[2]:15s} r={key[3]:<4} |dlogit| against {backend.partition(':')[0]} "
                  f"{row['max_abs_logit_diff_vs_default_gemm']:.3g}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
