"""What a worker's first requests cost, with and without the start-up warm-up (services/engine/graphs/warmup.py).

Llama-3-8B-shaped model with random weights, bf16, one process per setting, each with its own empty Triton cache
(set TRITON_CACHE_DIR per run: the cache on disk would otherwise carry one run's compiles into the next). With
``--warm on`` the engine first runs ``warm_prefill`` and ``warm_decode`` as a worker does at start (timed). Then:
  - prefill: for each mode, the first request (6 x 512-token chunks never seen + a 64-token suffix: the first
    computes them) and the median of 5 more of the same request, each synchronised;
  - decode: 32 sequences (tessera at ratio 0.15, 6 of 12 resident chunks each), then decode steps over the first 1, 2, 4 .. 32 of them, the
    first step of each batch bucket and the median of 3 more (each step's tokens read back, as the batcher does).

    TRITON_CACHE_DIR=$(mktemp -d) python3 bench/warmup/warmup.py --warm off --out DIR/warmup_off.json
    TRITON_CACHE_DIR=$(mktemp -d) python3 bench/warmup/warmup.py --warm on --out DIR/warmup_on.json
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

from bench.engine.engine import LLAMA3_8B  # noqa: E402
from services.engine import Engine, ModelConfig  # noqa: E402
from services.engine.graphs.decode import BATCH_BUCKETS  # noqa: E402
from services.engine.graphs.warmup import warm_decode, warm_prefill  # noqa: E402

MODES = (("full", 0.0), ("prefix", 0.0), ("position_aware", 0.0), ("blend_copy", 0.15), ("tessera", 0.15),
         ("tessera", 0.0))


def synced(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def build(layers: int) -> Engine:
    import transformers

    hf_cfg = dict(LLAMA3_8B, num_hidden_layers=layers)
    config = transformers.LlamaConfig(**{k: v for k, v in hf_cfg.items() if k != "architectures"})
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    eng = Engine.from_state_dict(ModelConfig.from_hf_dict(hf_cfg), dict(hf.state_dict()), device="cuda",
                                 dtype=torch.bfloat16, kv_cache_bytes=12 << 30)
    del hf
    return eng


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warm", choices=("on", "off"), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    t0 = time.perf_counter()
    eng = build(args.layers)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
           "warm": args.warm, "load_s": time.perf_counter() - t0, "prefill": [], "decode": []}
    if args.warm == "on":
        res["warm_prefill"] = warm_prefill(eng, (0.0, 0.15), only_cuda=True, progress=print)
        res["warm_decode"] = warm_decode(eng, 32, only_cuda=True, progress=print)
        print(f"warm-up: prefill {res['warm_prefill']['seconds']:.1f} s, decode {res['warm_decode']['seconds']:.1f} s")
    g = torch.Generator().manual_seed(7)

    def request():
        chunks = [torch.randint(0, 128000, (512,), generator=g).tolist() for _ in range(6)]
        return chunks, torch.randint(0, 128000, (64,), generator=g).tolist()

    for mode, ratio in MODES:
        chunks, suffix = request()
        first = synced(lambda: eng.prefill(chunks, suffix, mode=mode, recompute_ratio=ratio))
        laters = [synced(lambda: eng.prefill(chunks, suffix, mode=mode, recompute_ratio=ratio)) * 1e3
                  for _ in range(5)]
        later = statistics.median(laters)
        res["prefill"].append({"mode": mode, "ratio": ratio, "first_ms": first * 1e3, "later_ms": later,
                               "later_samples_ms": laters})
        print(f"prefill {mode}@{ratio}: first {first * 1e3:8.1f} ms, later {later:6.1f} ms "
              f"({' '.join(f'{x:.1f}' for x in laters)})", flush=True)

    seqs, tokens = [], []
    docs = [torch.randint(0, 128000, (512,), generator=g).tolist() for _ in range(12)]  # as bench/decode/decode.py
    for _ in range(BATCH_BUCKETS[-1]):
        order = torch.randperm(len(docs), generator=g)[:6].tolist()
        suffix = torch.randint(0, 128000, (64,), generator=g).tolist()
        logits, seq, _ = eng._prefill([docs[i] for i in order], suffix, "tessera", 0.15)
        seqs.append(seq)
        tokens.append(int(logits.argmax()))
    for b in BATCH_BUCKETS:
        def step():
            toks = eng.decode_step(seqs[:b], tokens[:b]).argmax(-1).tolist()  # read back, as the batcher does
            tokens[:b] = toks

        first = synced(step)
        later = statistics.median(synced(step) for _ in range(3))
        res["decode"].append({"batch": b, "first_ms": first * 1e3, "later_ms": later * 1e3})
        print(f"decode batch {b:2d}: first {first * 1e3:8.1f} ms, later {later * 1e3:6.1f} ms", flush=True)
    for seq in seqs:
        eng.release(seq)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
