"""Layer-major prefill of a retrieval decode (services/engine/passes/layered.py) against the ordinary pass, in one run
on one machine: a context larger than the KV pool served, and what it costs.

Llama-3-8B shape, random weights, bf16, Triton backend. One request: ``--context`` random tokens in mode ``full``
(every token computed in its context), decoded by retrieval (k, sink, window as given). Two engines over the same
weights:

- ``ordinary``: a pool large enough for the context (``--ordinary-pool-gib``), ``layered_prefill="never"``: the pass
  holds every layer's K/V in the pool, then the sequence offloads them (the copy thread, then the builds);
- ``layered``: a pool far smaller than the context's K/V (``--pool-gib``), ``layered_prefill="always"`` (what "auto"
  picks there): one layer's K/V at a time, each copied and built while the next layer computes.

For each, in the order ``--order`` gives: the pass's seconds (the first token's logits), the seconds until its indexes
are built (its second token can come), the peak GPU memory the process allocated, and --steps greedy steps (median
ms a token). Beside them: the ordinary engine's dense prefill of the same request (the peer of the first token's
time), the prefill's FLOP floor at the bf16 GEMM rate measured in the same run, the logits of the two retrieval
passes against each other, and the greedy tokens each generated.

    python3 bench/decode/layered.py --context 131072 --pool-gib 4 --ordinary-pool-gib 40 --steps 8 \
        --host-dtype bfloat16 --repair-queries 256 --out bench/decode/DATE_DEVICE_COMMIT_layered.json

``--service``: each engine's index set is a retrieval-index service on the same host (as a decode worker's, over
gRPC, its composition repair at the service's default) instead of an in-process ``IndexSet``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.decode.sparse import commit_of, random_state  # noqa: E402
from bench.engine.engine import LLAMA3_8B  # noqa: E402
from services.engine import Engine, ModelConfig  # noqa: E402
from services.engine.decode import DENSE, RetrievalDecode  # noqa: E402
from services.engine.options import EngineOptions  # noqa: E402


def gemm_flops_per_second(n: int = 8192, reps: int = 20) -> float:
    """bf16 GEMM rate of this device: an n x n x n matmul, timed over ``reps``."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n ** 3 * reps / (time.perf_counter() - t0)


def prefill_flops(cfg: ModelConfig, n: int) -> float:
    """A causal prefill's matmul FLOPs over n tokens: the layers' projections and MLP (2 x weights x tokens), causal
    attention (QK^T and PV over n^2 / 2 pairs a head), and the last token's logits."""
    h, d, hq, hkv, inter = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    per_layer = h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * inter
    return cfg.num_layers * (2 * per_layer * n + 2 * 2 * hq * d * n * n / 2) + 2 * h * cfg.vocab_size


def run(eng, chunks, suffix, policy, steps: int, scan_steps: int = 0) -> dict:
    """One request prefilled and decoded: the pass's seconds, those until it could step (``ready``: its K/V held to
    scan, or its indexes built) and until its indexes were built, peak GPU memory, up to ``scan_steps`` steps while
    they build (each layer not yet indexed scanned whole), the greedy tokens and the step times once built, the first
    token's logits (on the host)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    logits, seq = eng.prefill_sequence(chunks, suffix, mode="full", decode=policy, extra_tokens=steps + 4)
    torch.cuda.synchronize()
    pass_s = time.perf_counter() - t0
    tokens, scans = [int(logits.argmax())], []

    def step() -> float:
        t1 = time.perf_counter()
        tokens.append(int(eng.decode_step([seq], tokens[-1:])[0].argmax()))
        return time.perf_counter() - t1

    try:
        off = seq.offload
        ready_s = built_s = None
        if off is not None:
            while not seq.decode.ready(seq):       # its K/V held (decode_while_building), or its indexes built
                time.sleep(0.005)
            ready_s = time.perf_counter() - t0
            while not off.build.done() and len(scans) < scan_steps:    # steps scanning the layers not indexed
                scans.append(step())
            off.build.result()
            built_s = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() - base
        times = [step() for _ in range(steps)]
        return {"pass_seconds": pass_s, "ready_seconds": ready_s, "built_seconds": built_s,
                "peak_gpu_gib_above_start": peak / 2**30, "pool_blocks_held": len(seq.private_blocks),
                "ms_a_token": statistics.median(times[2:]) * 1e3, "tokens": tokens,
                "steps_while_building": len(scans),
                "ms_a_token_while_building": statistics.median(scans) * 1e3 if scans else None,
                "offload_seconds": None if off is None else dict(off.seconds), "logits": logits.float().cpu()}
    finally:
        eng.release(seq)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--pool-gib", type=float, default=4.0, help="the layered engine's KV pool")
    ap.add_argument("--ordinary-pool-gib", type=float, default=40.0, help="the ordinary engine's: the context fits")
    ap.add_argument("--order", default="ordinary,layered")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--sink", type=int, default=128)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--max-positions", type=int, default=None)
    ap.add_argument("--host-dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--repair-queries", type=int, default=256)
    ap.add_argument("--warm-context", type=int, default=4096,
                    help="a request of this many tokens on each engine first (compiles the kernels and numba loops)")
    ap.add_argument("--no-dense", action="store_true", help="leave out the dense prefill peer")
    ap.add_argument("--wait-for-builds", action="store_true",
                    help="EngineOptions(decode_while_building=False): the first step waits for every index")
    ap.add_argument("--scan-steps", type=int, default=16,
                    help="steps timed while the indexes build, at most (each scans the layers not yet indexed)")
    ap.add_argument("--service", action="store_true",
                    help="every engine's index set is a retrieval-index service on this host (a decode worker's), "
                         "reached over gRPC, rather than in process")
    args = ap.parse_args()
    hf_cfg = dict(LLAMA3_8B, num_hidden_layers=args.layers)
    if args.max_positions:
        hf_cfg["max_position_embeddings"] = args.max_positions
    cfg = ModelConfig.from_hf_dict(hf_cfg)
    state = random_state(hf_cfg, args.layers)
    cores = len(os.sched_getaffinity(0))
    from services.index.heads import IndexSet

    service = None
    if args.service:        # as a decode worker's: the service on its node, its loops readied before it listens
        from services.index.client import IndexClient
        from services.index.server import BackgroundIndexServer

        t0 = time.perf_counter()
        service = BackgroundIndexServer(threads=cores, host_dtype=args.host_dtype)
        print(f"index service up in {time.perf_counter() - t0:.1f} s", flush=True)

    engines = {}
    wanted = set(args.order.split(",")) | (set() if args.no_dense else {"ordinary"})
    for name, gib, choice in (("ordinary", args.ordinary_pool_gib, "never"), ("layered", args.pool_gib, "always")):
        if name not in wanted:
            continue
        eng = Engine.from_state_dict(cfg, state, device="cuda", dtype=torch.bfloat16, attention_backend="triton",
                                     kv_cache_bytes=int(gib * 2**30), chunk_cache_bytes=int(min(gib, 1.0) * 2**30),
                                     static_tails=True,
                                     options=EngineOptions(layered_prefill=choice, index_threads=cores,
                                                           index_host_dtype=args.host_dtype,
                                                           decode_while_building=not args.wait_for_builds))
        eng.forward.indexes = (IndexSet(threads=cores, repair_queries=args.repair_queries, host_dtype=args.host_dtype)
                               if service is None else
                               IndexClient(service.address, host_dtype=args.host_dtype, timeout=60,
                                           offload_timeout=3600))
        engines[name] = eng
    del state
    torch.cuda.empty_cache()
    rate = gemm_flops_per_second()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128000, (args.context - args.steps - 4,), generator=g).tolist()   # and its steps: context
    chunks, suffix = [ids[:-64]], ids[-64:]
    policy = RetrievalDecode(retrieval_k=args.k, sink_tokens=args.sink, window_tokens=args.window)
    some = next(iter(engines.values()))
    need_gib = args.context * some.pool.block_bytes / some.block_size / 2**30
    out = {"device": torch.cuda.get_device_name(), "cpu_cores": os.cpu_count(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "commit": commit_of(), "context": args.context, "layers": args.layers,
           "k": args.k, "sink_tokens": args.sink, "window_tokens": args.window, "host_dtype": args.host_dtype,
           "repair_queries": args.repair_queries, "index_threads": cores, "order": args.order,
           "index_set": "service" if args.service else "in process",
           "pool_gib": {"layered": args.pool_gib, "ordinary": args.ordinary_pool_gib},
           "context_kv_gib": need_gib, "gemm_tflops": rate / 1e12,
           "prefill_floor_seconds": prefill_flops(cfg, args.context) / rate, "runs": {}}
    print(f"{out['device']}: {args.context} tokens need {need_gib:.1f} GiB of KV; the layered engine's pool "
          f"{args.pool_gib} GiB; bf16 GEMM {rate / 1e12:.0f} TFLOP/s; prefill floor "
          f"{out['prefill_floor_seconds']:.2f} s", flush=True)
    for name, eng in engines.items():
        t0 = time.perf_counter()
        warm = torch.randint(0, 128000, (args.warm_context,), generator=g).tolist()
        run(eng, [warm[:-64]], warm[-64:], policy, 3)
        print(f"  {name} warmed in {time.perf_counter() - t0:.1f} s", flush=True)
    logits = {}
    for name in args.order.split(","):
        got = run(engines[name], chunks, suffix, policy, args.steps, args.scan_steps)
        logits[name] = got.pop("logits")
        out["runs"][name] = got
        print(f"  {name}: pass {got['pass_seconds']:.2f} s, steps from {got['ready_seconds']:.2f} s "
              f"({got['steps_while_building']} while building, median {got['ms_a_token_while_building']} ms), indexes "
              f"built {got['built_seconds']:.2f} s, peak GPU +{got['peak_gpu_gib_above_start']:.1f} GiB, "
              f"{got['ms_a_token']:.2f} ms a token once built, pool blocks {got['pool_blocks_held']}", flush=True)
    if not args.no_dense:
        dense = run(engines["ordinary"], chunks, suffix, DENSE, args.steps)
        dense.pop("logits")
        out["runs"]["dense"] = dense
        print(f"  dense: pass {dense['pass_seconds']:.2f} s, {dense['ms_a_token']:.2f} ms a token", flush=True)
    if len(logits) == 2:
        a, b = logits["ordinary"], logits["layered"]
        out["logits_max_abs_diff"] = float((a - b).abs().max())
        out["logits_scale"] = float(a.abs().max())
        out["first_token_equal"] = bool(a.argmax() == b.argmax())
        ta, tb = out["runs"]["ordinary"]["tokens"], out["runs"]["layered"]["tokens"]
        out["greedy_tokens_equal"] = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        print(f"  logits: max |ordinary - layered| {out['logits_max_abs_diff']:.4f} of {out['logits_scale']:.2f}; "
              f"greedy tokens equal for {out['greedy_tokens_equal']} of {len(ta)}", flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    if service is not None:
        service.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
