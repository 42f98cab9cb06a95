"""Decode-step benchmark (GPU): ms per batched decode step, with CUDA graphs (decode_graphs.py) and without.

Llama-3-8B-shaped model with random weights, bf16. B sequences (8 and 32 by default), each a tessera
prefill over 6 x 512-token chunks (drawn from a pool of 12 resident chunks, each sequence its own
order and choice) plus a 64-token suffix, at recompute ratio 0 (one table view for every layer) and
0.15 (two views: layer 0 and the rest). Then decode steps over the whole batch, as the decode batcher
runs them: one ``Engine.decode_step`` and a greedy pick (whose copy to the host syncs, as sampling
does). Rows: graphs ``on`` / ``off`` (the eager step), median ms per step over ``--steps`` steps
after warm-up (the first graph step captures; its time is reported apart), host syncs inside one
step (torch's sync debug mode), and the largest logit difference graphs vs eager on the same state
(the eager step's KV slot rewound, then the graph step). Peer in the same run: the weights' bytes
read once at the measured HBM bandwidth of a device copy (the floor of a decode step).

    python3 bench/decode/decode.py --out bench/decode/decode.json [--batches 8,32] [--ratios 0,0.15] [--graphs on,off]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.engine.engine import LLAMA3_8B, count_syncs  # noqa: E402
from services.engine import Engine, ModelConfig  # noqa: E402


def hbm_floor_seconds(n_bytes: int) -> float:
    """Time to read n_bytes once, at the bandwidth of a large device-to-device copy."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    per_byte = (time.perf_counter() - t0) / (10 * 2 * a.numel())  # a copy reads and writes each byte
    return n_bytes * per_byte


def make_batch(eng, pool, n: int, ratio: float, chunks_per_seq: int, suffix_tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    seqs, tokens = [], []
    for _ in range(n):
        order = torch.randperm(len(pool), generator=g)[:chunks_per_seq].tolist()
        suffix = torch.randint(0, min(128000, eng.cfg.vocab_size), (suffix_tokens,), generator=g).tolist()
        logits, seq, _ = eng._prefill([pool[i] for i in order], suffix, "tessera", ratio)
        seqs.append(seq)
        tokens.append(int(logits.argmax()))
    return seqs, tokens


def rewind(eng, seqs, marks) -> None:
    """Undo decode steps back to ``marks`` [(gen_count, next_pos, gen blocks)] (their KV slots are rewritten)."""
    for seq, (count, pos, n_blocks) in zip(seqs, marks):
        eng.pool.free(seq.gen_blocks[n_blocks:])
        del seq.gen_blocks[n_blocks:]
        seq.gen_count, seq.next_pos = count, pos


def graphs_against_eager(eng, seqs, tokens, marks, steps: int, restart=None) -> dict:
    """The same ``steps`` steps (``tokens`` fed at each) with the engine's graphs on and then off, each from the
    start ``marks`` (``rewind``; ``restart()``, if given, after it): the largest logit difference, the logits' scale,
    and whether the sequences' stats agree (timings left out). The sequences end rewound."""
    runs = []
    for graphs in (True, False):
        rewind(eng, seqs, marks)
        for s in seqs:
            s.decode_stats = type(s.decode_stats)()
        if restart is not None:
            restart()
        eng.forward.static_tails = graphs
        logits = torch.stack([eng.decode_step(seqs, list(tokens)).float() for _ in range(steps)])
        runs.append((logits, [{k: v for k, v in s.decode_stats.as_dict().items() if k != "retrieval_seconds"}
                              for s in seqs]))
    eng.forward.static_tails = True
    rewind(eng, seqs, marks)
    (g, g_stats), (e, e_stats) = runs
    return {"steps": steps, "max_abs_logit_diff": float((g - e).abs().max()), "logit_scale": float(e.abs().max()),
            "stats_equal": g_stats == e_stats}


def run_rows(eng, seqs, tokens, graphs: list[str], steps: int, label: dict) -> list[dict]:
    rows, fwd = [], eng.forward
    toks = list(tokens)
    for mode in graphs:
        fwd.static_tails = mode == "on"

        def step():
            nonlocal toks
            toks = eng.decode_step(seqs, toks).argmax(-1).tolist()  # to the host: a sync, as sampling is

        t0 = time.perf_counter()
        step()  # first step (the graph step captures here)
        first = time.perf_counter() - t0
        for _ in range(2):
            step()
        samples = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            samples.append(time.perf_counter() - t0)
        held = {}
        n_syncs, sites = count_syncs(lambda: held.setdefault("logits", eng.decode_step(seqs, toks)))
        toks = held["logits"].argmax(-1).tolist()
        ms = statistics.median(samples) * 1e3
        graphs_held = len(fwd.decode_graphs.graphs) if getattr(fwd, "decode_graphs", None) else 0
        rows.append({**label, "graphs": mode, "ms_per_step": ms, "first_step_ms": first * 1e3,
                     "p90_ms": sorted(samples)[int(0.9 * (len(samples) - 1))] * 1e3, "tokens_per_s": len(seqs) / ms * 1e3,
                     "host_syncs_per_step": n_syncs, "host_sync_sites": sites, "graphs_held": graphs_held})
        print(f"B={label['batch']:<3d} r={label['ratio']:<5} graphs {mode:3s} {ms:7.2f} ms/step "
              f"(first {first * 1e3:7.1f} ms)  {len(seqs) / ms * 1e3:7.0f} tok/s  {n_syncs} syncs", flush=True)
    if "on" in graphs and "off" in graphs:
        marks = [(s.gen_count, s.next_pos, len(s.gen_blocks)) for s in seqs]
        fwd.static_tails = False
        eager = eng.decode_step(seqs, toks)
        rewind(eng, seqs, marks)
        fwd.static_tails = True
        static = eng.decode_step(seqs, toks)
        diff = float((static - eager).abs().max())
        for row in rows:
            row["max_abs_logit_diff_graphs_vs_eager"] = diff
        print(f"B={label['batch']:<3d} r={label['ratio']:<5} |dlogit| graphs vs eager {diff:.3g}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/decode/decode.json")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--ratios", default="0,0.15")
    ap.add_argument("--graphs", default="on,off", help="decode graphs on, off, or both")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--chunks", type=int, default=6, help="chunks per sequence")
    ap.add_argument("--chunk-pool", type=int, default=12, help="distinct resident chunks the sequences draw from")
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--suffix-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    import transformers

    hf_cfg = dict(LLAMA3_8B, num_hidden_layers=args.layers)
    config = transformers.LlamaConfig(**{k: v for k, v in hf_cfg.items() if k != "architectures"})
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    cfg = ModelConfig.from_hf_dict(hf_cfg)
    state = dict(hf.state_dict())
    weight_bytes = sum(t.numel() * t.element_size() for t in state.values())
    floor = hbm_floor_seconds(weight_bytes)
    g = torch.Generator().manual_seed(1)
    pool = [torch.randint(0, 128000, (args.chunk_tokens,), generator=g).tolist() for _ in range(args.chunk_pool)]
    eng = Engine.from_state_dict(cfg, state, device="cuda", dtype=torch.bfloat16, attention_backend=args.backend,
                                 kv_cache_bytes=12 << 30, static_tails=True)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
               "layers": args.layers, "backend": args.backend, "chunks_per_seq": args.chunks,
               "chunk_tokens": args.chunk_tokens, "suffix_tokens": args.suffix_tokens,
               "weight_bytes": weight_bytes, "peer_weights_read_once_ms": floor * 1e3, "rows": []}
    print(f"peer: {weight_bytes / 2**30:.1f} GiB of weights read once at copy bandwidth: {floor * 1e3:.2f} ms", flush=True)
    for ratio in (float(r) for r in args.ratios.split(",")):
        for n in (int(b) for b in args.batches.split(",")):
            seqs, tokens = make_batch(eng, pool, n, ratio, args.chunks, args.suffix_tokens, seed=n)
            try:
                label = {"batch": n, "ratio": ratio, "context_tokens": seqs[0].next_pos}
                results["rows"] += run_rows(eng, seqs, tokens, args.graphs.split(","), args.steps, label)
            except Exception as exc:  # report and go on: one shape failing must not hide the others
                results["rows"].append({"batch": n, "ratio": ratio, "error": repr(exc)[:2000]})
                print(f"B={n} r={ratio}: {exc!r}"[:1000], flush=True)
            finally:
                for seq in seqs:
                    eng.release(seq)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
