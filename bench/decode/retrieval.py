"""Retrieval decode benchmark (GPU + the host's cores): RetrievalAttention's decode step against our dense decode, in
one run on one machine.

Llama-3-8B shape, random weights, bf16, Triton backend. A sequence's context is C tokens of 512-token chunks with
random normal KV (inserted as the store would hand them) and a 64-token suffix whose prefill queries train the
indexes (the engine's query tap). Per context it reports:

- the retrieval sequence's start: offloading every layer's K/V outside the static set to host memory, then the
  build of its indexes (on the host's cores) that runs behind it, three ways: one index per (layer, KV head) over
  all its keys (``per_request``, the peer, at the contexts ``--per-request`` names), the chunks' own indexes built
  first (``chunks_cold``: every chunk runs alone to tap its queries, its graphs build), and a second sequence over
  the same chunks reusing them (``chunks_warm``: only the keys outside whole chunks get a graph);
- the whole decode step, as the decode batcher runs it (``Engine.decode_step`` and a greedy pick read back): dense
  (replayed as a CUDA graph, the default) against retrieval (k, sink, window as given), medians over --steps steps,
  with the share of a retrieval step spent in the CPU searches and attention; a layer's searches in one compiled
  call (``services/index/_layer.py``, the default) and, for the same sequence, on the thread pool (``pool_ms``),
  a step of each in turn (since 2026-11-28 20:30 UTC; before, all of one and then all of the other);
- the floor of the dense step: the bytes it must read (weights once, every page's K/V) at the device's copy
  bandwidth measured in the same run.

Random keys make no statement about recall (tests/index and bench/index measure that on trained models' Q/K);
this measures time.

    python3 bench/decode/retrieval.py --contexts 8192,32768,131072 --per-request 8192 \
        --out bench/decode/DATE_DEVICE_COMMIT_retrieval.json
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import os
import pstats
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.decode.decode import graphs_against_eager, hbm_floor_seconds  # noqa: E402
from bench.decode.profiling import profile_calls  # noqa: E402
from bench.decode.sparse import CHUNK, commit_of, random_engine  # noqa: E402
from services.engine.decode import QueryTap, RetrievalDecode  # noqa: E402
from services.index import _layer  # noqa: E402


def start_profile(call) -> list[dict]:
    """``call()`` under cProfile: its 25 functions of most cumulative time (where a retrieval sequence's start goes)."""
    prof = cProfile.Profile()
    prof.runcall(call)
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][3])[:25]
    return [{"function": f"{Path(file).name}:{line}({name})", "calls": n, "own_s": tt, "cumulative_s": ct}
            for (file, line, name), (_, n, tt, ct, _) in rows]


def one_sequence(eng, context: int, seed: int, decode, distinct: int = 0, profile: list | None = None):
    """A sequence of ``context`` chunk tokens (random KV inserted per chunk) and a 64-token suffix, prefilled with
    its queries tapped and started under ``decode``: (sequence, first token, seconds its start took). ``distinct``
    (> 0): the context's chunks cycle through that many distinct ones, each placed at several offsets (its keys
    rotated apart by each), so that a long context's chunk indexes build in the time of a few."""
    g = torch.Generator().manual_seed(seed)
    cfg = eng.cfg
    chunks = []
    for i in range((context - 128) // CHUNK):
        if distinct and i >= distinct:
            chunks.append(chunks[i % distinct])
            continue
        tokens = torch.randint(0, 128000, (CHUNK,), generator=g).tolist()
        kv = [(torch.randn(CHUNK, cfg.num_kv_heads, cfg.head_dim, device="cuda", dtype=torch.bfloat16),
               torch.randn(CHUNK, cfg.num_kv_heads, cfg.head_dim, device="cuda", dtype=torch.bfloat16))
              for _ in range(cfg.num_layers)]
        eng.insert_chunk(eng.chunk_id(tokens), tokens, kv)
        chunks.append(tokens)
    suffix = torch.randint(0, 128000, (64,), generator=g).tolist()
    tap = QueryTap()
    eng.forward.query_tap = tap
    try:
        logits, seq, _ = eng._prefill(chunks, suffix, "tessera", 0.0)
    finally:
        eng.forward.query_tap = None
    seq.prefill_queries = tap
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if profile is None:
        eng.start_decode(seq, decode)
    else:
        profile.extend(start_profile(lambda: eng.start_decode(seq, decode)))
    return seq, int(logits.argmax()), time.perf_counter() - t0


def time_steps(eng, seq, tok: int, steps: int) -> tuple[list[float], float]:
    """Step times (s) after 3 warm-up steps (the first searches compile), and the CPU's part per timed step (s)."""
    cur = [tok]
    for _ in range(3):
        cur = eng.decode_step([seq], cur).argmax(-1).tolist()
    torch.cuda.synchronize()
    cpu0 = seq.decode_stats.retrieval_seconds
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        cur = eng.decode_step([seq], cur).argmax(-1).tolist()
        samples.append(time.perf_counter() - t0)
    return samples, (seq.decode_stats.retrieval_seconds - cpu0) / steps


def alternated_steps(eng, seq, tok: int, steps: int, use) -> tuple[tuple[list[float], float], tuple[list[float], float]]:
    """The sequence's steps with ``use(True)`` and ``use(False)`` in turn, after 3 warm-up steps of each: (step
    times, CPU part per step) of each, as ``time_steps`` gives them; ``use(True)`` again after."""
    cur = [tok]
    times: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, float] = {True: 0.0, False: 0.0}
    try:
        for i in range(6 + 2 * steps):
            on = i % 2 == 0
            use(on)
            torch.cuda.synchronize()
            cpu0, t0 = seq.decode_stats.retrieval_seconds, time.perf_counter()
            cur = eng.decode_step([seq], cur).argmax(-1).tolist()
            if i >= 6:
                times[on].append(time.perf_counter() - t0)
                cpu[on] += seq.decode_stats.retrieval_seconds - cpu0
    finally:
        use(True)
    return (times[True], cpu[True] / steps), (times[False], cpu[False] / steps)


def profile_steps(eng, seq, tok: int, steps: int) -> dict:
    """``steps`` decode steps under torch.profiler (bench/decode/profiling.py): what a step spends outside the
    index's search."""
    cur = [tok]

    def step():
        nonlocal cur
        cur = eng.decode_step([seq], cur).argmax(-1).tolist()

    return profile_calls(step, steps)


def timed_start(eng, context: int, policy, chunk_indexes: bool, distinct: int, profile: list | None = None):
    """A retrieval sequence over the context's chunks (the same chunks for the same context), its indexes built:
    (sequence, first token, start seconds, build seconds after the start). ``profile``: filled with the start's
    profile (``start_profile``)."""
    eng.forward.options = dataclasses.replace(eng.forward.options, chunk_indexes=chunk_indexes)
    seq, tok, start_s = one_sequence(eng, context, context, policy, distinct, profile)
    t0 = time.perf_counter()
    seq.offload.build.result()          # the indexes' build, behind the start on its own thread
    return seq, tok, start_s, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--per-request", default="32768",
                    help="contexts where a sequence building one index over all its keys runs too (the peer)")
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--sink", type=int, default=128)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--kv-gib", type=float, default=40.0)
    ap.add_argument("--variants", default="chunks_cold,chunks_warm",
                    help="of chunks_cold (the chunks' indexes built first), chunks_warm (a second sequence reusing them)")
    ap.add_argument("--repair-queries", type=int, default=None,
                    help="at most this many of a KV head's request queries repair a composition of chunk graphs "
                         "(IndexSet; default: all of them, 8,192 a KV head): the repair is most of a long context's "
                         "wait before its first step")
    ap.add_argument("--no-scan", action="store_true",
                    help="never scan a head whole (IndexSet(scan_share=None)): its graph searches only, the peer of "
                         "the scans that heads whose graph searches read widely take (services/index/_scan.py)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile two retrieval steps a variant (torch.profiler): the host's and the GPU's time "
                         "by op, a step's GPU busy time")
    ap.add_argument("--distinct", type=int, default=0,
                    help="distinct chunks a context cycles through (0: every chunk its own): one_sequence")
    ap.add_argument("--profile-start", action="store_true",
                    help="profile each retrieval sequence's start (cProfile): where the engine thread's time goes")
    ap.add_argument("--max-positions", type=int, default=None,
                    help="the shape's max_position_embeddings raised (131,072) for contexts past it (512K)")
    ap.add_argument("--search-threads", type=int, default=None,
                    help="threads a step's searches use (default: every core this process may run on; the builds "
                         "use those whatever this says), to time a host of fewer cores")
    ap.add_argument("--host-dtype", default="float32", choices=("float32", "bfloat16"),
                    help="how the index set holds the offloaded keys and values (IndexSet(host_dtype=)): bfloat16 "
                         "halves them (512K tokens' 137 GB in float32 do not fit a 128 GiB host)")
    args = ap.parse_args()
    eng, cfg, weight_bytes = random_engine(args.layers, args.kv_gib, args.max_positions)
    floor_per_byte = hbm_floor_seconds(1 << 30) / (1 << 30)
    commit = commit_of()
    from services.index.heads import SCAN_SHARE, IndexSet

    eng.forward.indexes = IndexSet(threads=len(os.sched_getaffinity(0)), repair_queries=args.repair_queries,
                                   scan_share=None if args.no_scan else SCAN_SHARE, host_dtype=args.host_dtype)
    eng.forward.options = dataclasses.replace(eng.forward.options, index_threads=len(os.sched_getaffinity(0)))
    per_request = {int(c) for c in args.per_request.split(",") if c}
    results = {"device": torch.cuda.get_device_name(), "cpu_cores": os.cpu_count(), "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d"), "commit": commit, "layers": args.layers, "k": args.k,
               "max_position_embeddings": cfg.max_position_embeddings,
               "sink_tokens": args.sink, "window_tokens": args.window, "weight_bytes": weight_bytes,
               "distinct_chunks": args.distinct or None, "repair_queries": args.repair_queries,
               "scan_share": None if args.no_scan else SCAN_SHARE, "host_dtype": args.host_dtype,
               "index_threads": len(os.sched_getaffinity(0)),
               "copy_bandwidth_gb_s": 1e-9 / floor_per_byte, "rows": []}
    print(f"{results['device']}, {results['cpu_cores']} CPU cores: copy bandwidth {1e-9 / floor_per_byte:.0f} GB/s",
          flush=True)
    policy = RetrievalDecode(retrieval_k=args.k, sink_tokens=args.sink, window_tokens=args.window)
    page_bytes = eng.pool.block_bytes
    for context in (int(c) for c in args.contexts.split(",")):
        row = {"context": context}
        print(f"context {context}", flush=True)
        seq = None
        try:
            seq, tok, _ = one_sequence(eng, context, context, eng.decode_policy("dense"), args.distinct)
            dense, _ = time_steps(eng, seq, tok, args.steps)
            eng.forward.static_tails = False        # the same step eager, as a retrieval step runs: its launch cost
            try:
                eager, _ = time_steps(eng, seq, tok, args.steps)
            finally:
                eng.forward.static_tails = True
            floor = weight_bytes + sum(t.num_entries for t in seq.layer_tables) // cfg.num_layers * page_bytes
            eng.release(seq)
            seq = None
            row |= {"dense_ms": statistics.median(dense) * 1e3, "dense_floor_ms": floor * floor_per_byte * 1e3,
                    "dense_eager_ms": statistics.median(eager) * 1e3}
            print(f"  dense {row['dense_ms']:.2f} ms (floor {row['dense_floor_ms']:.2f}), eager "
                  f"{row['dense_eager_ms']:.2f}", flush=True)
            # per-request: one index over every offloaded key; then the chunks' own indexes, built (cold), and
            # reused by a second sequence over the same chunks (warm)
            variants = (["per_request"] if context in per_request else []) + [v for v in ("chunks_cold", "chunks_warm")
                                                                            if v in args.variants.split(",")]
            for name in variants:
                indexes = eng.forward.indexes
                indexes.threads = len(os.sched_getaffinity(0))          # the builds on every core
                prof = [] if args.profile_start else None
                seq, tok, start_s, build_s = timed_start(eng, context, policy, name != "per_request", args.distinct,
                                                         prof)
                indexes.threads = args.search_threads or indexes.threads
                _layer.warm(args.host_dtype)            # the compiled layer call ready (its first add started it)
                # the compiled searches and the same sequence's steps on the thread pool (the peer), a step of each in
                # turn: a drift of the host's speed over the run moves both alike
                (samples, cpu), (pool, pool_cpu) = alternated_steps(
                    eng, seq, tok, args.steps, lambda on: setattr(eng.forward.indexes, "compiled", on))
                eng.forward.static_tails = False        # the same sequence's steps with no graph at all (the peer)
                try:
                    eager, eager_cpu = time_steps(eng, seq, tok, args.steps)
                finally:
                    eng.forward.static_tails = True
                st = seq.decode_stats
                row[name] = {"ms": statistics.median(samples) * 1e3,
                             "pool_ms": statistics.median(pool) * 1e3, "pool_cpu_ms_per_step": pool_cpu * 1e3,
                             "eager_ms": statistics.median(eager) * 1e3, "eager_cpu_ms_per_step": eager_cpu * 1e3,
                             "p90_ms": sorted(samples)[int(0.9 * (len(samples) - 1))] * 1e3,
                             "cpu_ms_per_step": cpu * 1e3, "start_seconds": start_s,
                             "build_seconds_after_start": build_s,
                             "offloaded_tokens_per_layer": seq.offload.offloaded[-1],
                             "keys_scanned_per_step": st.keys_scanned / max(1, st.steps),
                             "host_kv_bytes": eng.forward.indexes.held()[1],
                             "index_bytes": eng.forward.indexes.held()[2],
                             "chunk_indexes_held": (eng.forward.chunk_indexes.held()
                                                    if eng.forward.chunk_indexes is not None else None),
                             "search_threads": indexes.threads, "start_profile": prof,
                             "start_parts_seconds": dict(seq.offload.seconds),
                             "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
                # the same steps with graphs and without (after the stats above: it starts the sequence's afresh)
                check = row[name]["graphs_against_eager"] = graphs_against_eager(
                    eng, [seq], [tok], [(seq.gen_count, seq.next_pos, len(seq.gen_blocks))], 4)
                if args.profile:
                    row[name]["profile"] = profile_steps(eng, seq, tok, 2)
                print(f"  {name}: eager {row[name]['eager_ms']:.2f} ms/token ({eager_cpu * 1e3:.2f} on the CPU); graphs "
                      f"against eager: |dlogit| {check['max_abs_logit_diff']:.3g}", flush=True)
                print(f"  {name}: searched on a thread pool {row[name]['pool_ms']:.2f} ms/token ({pool_cpu * 1e3:.2f} "
                      f"on the CPU)", flush=True)
                print(f"  {name}: {row[name]['ms']:.2f} ms/token ({cpu * 1e3:.2f} ms of it on the CPU); start "
                      f"{start_s:.1f} s + builds {build_s:.1f} s for {row[name]['offloaded_tokens_per_layer']} keys "
                      f"a layer; {row[name]['keys_scanned_per_step']:.0f} keys scanned a step", flush=True)
                eng.release(seq)
                seq = None
        except Exception as exc:   # report and go on
            row["error"] = repr(exc)[:2000]
            print(f"  failed: {exc!r}"[:1500], flush=True)
        finally:
            if seq is not None:
                eng.release(seq)
            eng.cache.clear()
            eng.forward.chunk_indexes = None
            torch.cuda.empty_cache()
        results["rows"].append(row)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
