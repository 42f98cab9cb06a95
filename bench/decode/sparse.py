"""Sparse decode benchmark (GPU): Quest and RetroAttention against our dense decode, in one run on one machine.

Llama-3-8B shape, random weights, bf16, Triton backend. Every sequence's context is C tokens of 512-token chunks
(each sequence its own chunks unless --shared) and a 64-token suffix; the chunks' KV are random normal values
inserted as the store would hand them (insert_chunk), so building a 128K context costs no prefill. Per
(context, batch) it reports:

- attention per step: one sparse layer's attention timed alone (replayed as a CUDA graph, the batch's real
  table), dense (the paged decode kernel a dense step runs, its split count) against Quest's three kernels
  (scores, top-k, sparse attention) at each budget, times the model's layers (dense layers at the dense figure);
- whole decode step, as the decode batcher runs it (``Engine.decode_step`` and a greedy pick read back): dense,
  Quest and Retro (w=2) at each budget, each replayed as a CUDA graph (the default), medians over --steps steps;
- the floor of each step: bytes it must read (weights once; per KV head and layer the pages read; the page
  bounds read to score them) at the device's copy bandwidth measured in the same run;
- page bounds' bytes per 512-token chunk against the chunk's KV bytes.

    python3 bench/decode/sparse.py --contexts 32768,131072 --batches 1,4 --budgets 1024,2048,4096 \\
        --out bench/decode/DATE_DEVICE_COMMIT_sparse.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.decode.decode import graphs_against_eager, hbm_floor_seconds, rewind  # noqa: E402
from bench.decode.profiling import profile_calls  # noqa: E402
from bench.engine.engine import LLAMA3_8B  # noqa: E402
from kernels import sparse  # noqa: E402
from kernels.paged_attention._decode import DecodeConfig, pick_splits  # noqa: E402
from kernels.paged_attention._decode import launch as decode_launch  # noqa: E402
from kernels.paged_attention._meta import pack  # noqa: E402
from services.engine import Engine, ModelConfig  # noqa: E402
from services.engine.kv.block_table import BlockTable  # noqa: E402

CHUNK = 512


def random_state(hf_cfg: dict, layers: int) -> dict:
    """Hugging Face-named random bf16 weights of the model's shapes (no transformers model: one copy in memory)."""
    h, inter, hq, hkv = hf_cfg["hidden_size"], hf_cfg["intermediate_size"], hf_cfg["num_attention_heads"], \
        hf_cfg["num_key_value_heads"]
    d, vocab = h // hq, hf_cfg["vocab_size"]
    g = torch.Generator(device="cuda").manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16) * shape[-1] ** -0.5)

    state = {"model.embed_tokens.weight": w(vocab, h), "model.norm.weight": torch.ones(h, device="cuda",
                                                                                      dtype=torch.bfloat16),
             "lm_head.weight": w(vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        state |= {p + "self_attn.q_proj.weight": w(hq * d, h), p + "self_attn.k_proj.weight": w(hkv * d, h),
                  p + "self_attn.v_proj.weight": w(hkv * d, h), p + "self_attn.o_proj.weight": w(h, hq * d),
                  p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
                  p + "mlp.down_proj.weight": w(h, inter),
                  p + "input_layernorm.weight": torch.ones(h, device="cuda", dtype=torch.bfloat16),
                  p + "post_attention_layernorm.weight": torch.ones(h, device="cuda", dtype=torch.bfloat16)}
    return state


def random_engine(layers: int, kv_gib: float, max_positions: int | None = None):
    """(engine, its ModelConfig, weight bytes): Llama-3-8B's shape with ``layers`` layers, random bf16 weights, the
    Triton backend, CUDA graphs, ``kv_gib`` GiB of KV pool (and of chunk cache within it). ``max_positions``: the
    shape's max_position_embeddings raised (131,072) for longer contexts (the weights are random anyway)."""
    hf_cfg = dict(LLAMA3_8B, num_hidden_layers=layers)
    if max_positions is not None:
        hf_cfg["max_position_embeddings"] = max_positions
    cfg = ModelConfig.from_hf_dict(hf_cfg)
    state = random_state(hf_cfg, layers)
    weight_bytes = sum(t.numel() * t.element_size() for t in state.values())
    eng = Engine.from_state_dict(cfg, state, device="cuda", dtype=torch.bfloat16, attention_backend="triton",
                                 kv_cache_bytes=int(kv_gib * 2**30), chunk_cache_bytes=int(kv_gib * 2**30),
                                 static_tails=True)
    del state
    torch.cuda.empty_cache()
    return eng, cfg, weight_bytes


def commit_of() -> str:
    """The commit measured: $COMMIT (a device's tree has no .git), else this checkout's head."""
    return os.environ.get("COMMIT") or os.environ.get("TESSERA_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                       text=True).stdout.strip()


def build_batch(eng, n: int, context: int, shared: bool, seed: int):
    """n sequences of ``context`` chunk tokens (random KV inserted per chunk) and a 64-token suffix."""
    g = torch.Generator().manual_seed(seed)
    cfg = eng.cfg
    per_seq = (context - 128) // CHUNK        # the suffix and the generated tokens stay within ``context``
    sets = 1 if shared else n
    chunk_sets = []
    for _ in range(sets):
        chunks = []
        for _ in range(per_seq):
            tokens = torch.randint(0, 128000, (CHUNK,), generator=g).tolist()
            kv = [(torch.randn(CHUNK, cfg.num_kv_heads, cfg.head_dim, device="cuda", dtype=torch.bfloat16),
                   torch.randn(CHUNK, cfg.num_kv_heads, cfg.head_dim, device="cuda", dtype=torch.bfloat16))
                  for _ in range(cfg.num_layers)]
            eng.insert_chunk(eng.chunk_id(tokens), tokens, kv)
            chunks.append(tokens)
        chunk_sets.append(chunks)
    seqs, toks = [], []
    for i in range(n):
        suffix = torch.randint(0, 128000, (64,), generator=g).tolist()
        logits, seq, _ = eng._prefill(chunk_sets[0 if shared else i], suffix, "tessera", 0.0)
        seqs.append(seq)
        toks.append(int(logits.argmax()))
    return seqs, toks


def graph_ms(fn, reps: int = 50) -> float:
    """GPU time of ``fn``'s kernels: captured into a CUDA graph and replayed ``reps`` times back to back (the host's
    launches out of the figure, as a decode step's graph replays them), ms per replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()                                   # compiles, allocator settles
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def attention_rows(eng, seqs, budgets, dense_layers: int) -> list[dict]:
    """One layer's attention alone at the batch's real table: dense against Quest's kernels, per budget."""
    fwd, dev, layer = eng.forward, eng.device, eng.cfg.num_layers - 1
    pool, model = eng.pool, fwd.model
    # the page bounds: computed by the first sparse decode of fresh chunks, reused by the next request
    policy = eng.decode_policy("quest", budget_tokens=max(budgets))
    bounds_ms = []
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for s in seqs:
            eng.start_decode(s, policy)
        torch.cuda.synchronize()
        bounds_ms.append((time.perf_counter() - t0) * 1e3)
    n_chunks = sum(len(s.pinned) for s in seqs)
    print(f"  page bounds of {n_chunks} chunks: {bounds_ms[0]:.2f} ms when first read, {bounds_ms[1]:.2f} ms reused",
          flush=True)
    gen = [BlockTable.for_run(s.gen_blocks, s.gen_count, eng.block_size, 0, dev) for s in seqs]
    table, cu = fwd._step_table(layer, seqs, gen, dev)
    q = torch.randn(len(seqs), eng.cfg.num_heads, eng.cfg.head_dim, device=dev, dtype=torch.bfloat16)
    packed = pack(table.block_ids, table.offsets, table.masks, eng.block_size, model.inv_freq, with_table=False)
    splits = pick_splits(DecodeConfig(), len(seqs), eng.cfg.num_kv_heads, table.num_entries, dev)
    dense = graph_ms(lambda: decode_launch(q, pool.k[layer], pool.v[layer], packed, cu, model.inv_freq, model.scale,
                                           cfg=DecodeConfig(num_splits=splits)))
    rows = []
    n_layers = eng.cfg.num_layers
    for budget in budgets:
        pages = budget // eng.block_size

        def quest():
            scores = sparse.page_scores(q, pool.kmin[layer], pool.kmax[layer], table.block_ids, table.offsets,
                                        table.masks, cu, model.inv_freq, backend="triton")
            sel, count = sparse.select_pages(scores, cu, pages, backend="triton")
            return sparse.sparse_decode_attention(q, pool.k[layer], pool.v[layer], table.block_ids, table.offsets,
                                                  table.masks, sel, count, model.inv_freq, model.scale,
                                                  backend="triton")

        scores = sparse.page_scores(q, pool.kmin[layer], pool.kmax[layer], table.block_ids, table.offsets,
                                    table.masks, cu, model.inv_freq, backend="triton")
        sel, count = sparse.select_pages(scores, cu, pages, backend="triton")
        parts = {
            "scores_ms": graph_ms(lambda: sparse.page_scores(q, pool.kmin[layer], pool.kmax[layer], table.block_ids,
                                                              table.offsets, table.masks, cu, model.inv_freq,
                                                              backend="triton")),
            "select_ms": graph_ms(lambda: sparse.select_pages(scores, cu, pages, backend="triton")),
            "attend_ms": graph_ms(lambda: sparse.sparse_decode_attention(
                q, pool.k[layer], pool.v[layer], table.block_ids, table.offsets, table.masks, sel, count,
                model.inv_freq, model.scale, backend="triton")),
        }
        layer_ms = graph_ms(quest)
        step_dense = dense * n_layers
        step_quest = dense * dense_layers + layer_ms * (n_layers - dense_layers)
        rows.append({"budget_tokens": budget, "bounds_first_ms": bounds_ms[0], "bounds_reused_ms": bounds_ms[1],
                     "dense_layer_ms": dense, "quest_layer_ms": layer_ms, **parts,
                     "dense_attention_per_step_ms": step_dense, "quest_attention_per_step_ms": step_quest,
                     "attention_speedup": step_dense / step_quest})
        print(f"  attention budget {budget}: dense {dense:.3f} ms/layer, quest {layer_ms:.3f} "
              f"(scores {parts['scores_ms']:.3f}, select {parts['select_ms']:.3f}, attend {parts['attend_ms']:.3f}); "
              f"per step {step_dense:.2f} vs {step_quest:.2f} ms = {step_dense / step_quest:.2f}x", flush=True)
    return rows


def step_rows(eng, seqs, toks, policies, steps: int, floor_per_byte: float, weight_bytes: int,
              profile: bool = False) -> list[dict]:
    fwd = eng.forward
    marks = [(s.gen_count, s.next_pos, len(s.gen_blocks)) for s in seqs]
    cfg, bs = eng.cfg, eng.block_size
    page_bytes = bs * cfg.head_dim * 2 * 2            # one KV head's K and V of one page, bf16
    bound_bytes = cfg.head_dim * 2 * 2                 # one KV head's kmin and kmax of one page
    rows = []
    for label, policy, graphs in policies:
        rewind(eng, seqs, marks)
        for s in seqs:
            s.decode_stats = type(s.decode_stats)()
            eng.start_decode(s, policy)
        fwd.static_tails = graphs
        cur = list(toks)

        def step():
            nonlocal cur
            cur = eng.decode_step(seqs, cur).argmax(-1).tolist()

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        samples = []
        read0 = sum(s.decode_stats.pages_read for s in seqs)
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            samples.append(time.perf_counter() - t0)
        pages = (sum(s.decode_stats.pages_read for s in seqs) - read0) / steps
        visible = sum(s.decode_stats.visible(s, cfg.num_layers, cfg.num_kv_heads) for s in seqs)
        sparse_layers = cfg.num_layers - getattr(policy, "dense_layers", cfg.num_layers)
        meta = visible / cfg.num_layers * sparse_layers * bound_bytes if sparse_layers else 0
        floor_bytes = weight_bytes + pages * page_bytes + meta
        ms = statistics.median(samples) * 1e3
        rows.append({"policy": label, "graphs": graphs, "ms_per_step": ms,
                     "p90_ms": sorted(samples)[int(0.9 * (len(samples) - 1))] * 1e3,
                     "pages_read_per_step": pages, "pages_visible_per_step": visible,
                     "pages_corrected": sum(s.decode_stats.pages_corrected for s in seqs),
                     "floor_bytes": floor_bytes, "floor_ms": floor_bytes * floor_per_byte * 1e3})
        if profile:
            rows[-1]["profile"] = profile_calls(step, 5)
        if graphs:
            rows[-1]["graph_vs_eager"] = graphs_against_eager(
                eng, seqs, toks, marks, 6, lambda: [eng.start_decode(s, policy) for s in seqs])
        print(f"  step {label:16s} graphs={int(graphs)} {ms:8.2f} ms  floor {floor_bytes * floor_per_byte * 1e3:6.2f} "
              f"ms ({floor_bytes / 2**30:.2f} GiB)  pages {pages:.0f}/{visible}", flush=True)
        if graphs:
            check = rows[-1]["graph_vs_eager"]
            print(f"    graph against eager: |dlogit| {check['max_abs_logit_diff']:.3g} (logits up to "
                  f"{check['logit_scale']:.3g}), stats equal {check['stats_equal']}", flush=True)
    rewind(eng, seqs, marks)
    fwd.static_tails = True
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--budgets", default="1024,2048,4096")
    ap.add_argument("--shared", action="store_true", help="every sequence reads the same chunks")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--dense-layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--kv-gib", type=float, default=44.0)
    ap.add_argument("--eager", action="store_true", help="also a Quest step without graphs")
    ap.add_argument("--profile", action="store_true",
                    help="also five steps of each policy under torch.profiler (bench/decode/profiling.py): ops by host "
                         "and GPU time, the GPU's busy time a step")
    ap.add_argument("--skip", default="", help="context:batch pairs to skip, e.g. 131072:4")
    args = ap.parse_args()
    eng, cfg, weight_bytes = random_engine(args.layers, args.kv_gib)
    floor_per_byte = hbm_floor_seconds(1 << 30) / (1 << 30)
    commit = commit_of()
    mem = eng.describe_memory()
    chunk_kv = -(-CHUNK // eng.block_size) * mem["block_bytes"]
    chunk_bounds = -(-CHUNK // eng.block_size) * mem["page_bounds_bytes_per_block"]
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
               "commit": commit, "layers": args.layers, "dense_layers": args.dense_layers, "shared": args.shared,
               "weight_bytes": weight_bytes, "copy_bandwidth_gb_s": 1e-9 / floor_per_byte,
               "chunk_kv_bytes": chunk_kv, "chunk_page_bounds_bytes": chunk_bounds, "rows": []}
    print(f"{results['device']}: copy bandwidth {1e-9 / floor_per_byte:.0f} GB/s; a {CHUNK}-token chunk: KV "
          f"{chunk_kv / 2**20:.1f} MiB, page bounds {chunk_bounds / 2**20:.2f} MiB ({chunk_bounds / chunk_kv:.2%})",
          flush=True)
    budgets = [int(b) for b in args.budgets.split(",")]
    skip = set(args.skip.split(",")) - {""}
    for context in (int(c) for c in args.contexts.split(",")):
        for n in (int(b) for b in args.batches.split(",")):
            if f"{context}:{n}" in skip:
                continue
            label = {"context": context, "batch": n}
            print(f"context {context}, batch {n}{' (shared chunks)' if args.shared else ''}", flush=True)
            seqs = []
            try:
                seqs, toks = build_batch(eng, n, context, args.shared, seed=context + n)
                att = attention_rows(eng, seqs, budgets, args.dense_layers)
                policies = [("dense", eng.decode_policy("dense"), True)]
                for b in budgets:
                    policies.append((f"quest@{b}", eng.decode_policy("quest", budget_tokens=b,
                                                                     dense_layers=args.dense_layers), True))
                    policies.append((f"retro@{b}:w2", eng.decode_policy("retro", budget_tokens=b,
                                                                        dense_layers=args.dense_layers,
                                                                        retro_window=2), True))
                if args.eager:
                    policies.append((f"quest@{budgets[0]} eager", policies[1][1], False))
                steps = step_rows(eng, seqs, toks, policies, args.steps, floor_per_byte, weight_bytes, args.profile)
                results["rows"].append({**label, "attention": att, "steps": steps})
            except Exception as exc:   # report and go on: one shape failing must not hide the others
                results["rows"].append({**label, "error": repr(exc)[:2000]})
                print(f"  failed: {exc!r}"[:1500], flush=True)
            finally:
                for seq in seqs:
                    eng.release(seq)
                eng.cache.clear()
                torch.cuda.empty_cache()
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
