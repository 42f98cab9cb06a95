"""Host time a request costs the serving path before its prefill pass, per stage, on this machine's CPU.

A 6 x 512-token + 64-token request given as token ids (the engine bench's shape), through:
  gateway resolve   GenerateRequest -> ResolvedRequest (vocabulary check, chunk ids) on the gateway's loop;
  prefill request   ResolvedRequest -> PrefillRequest (the message the gateway sends);
  worker check      the prefill worker's Engine.check of the message's token ids (one conversion, chunk ids);
and the same request as text (six ~512-token documents and a question) through the gateway's resolve, with
every text tokenized and with the documents' token ids kept from an earlier request (the gateway's text cache,
where the tree has one); each the minimum over repeats of a timeit loop (the least disturbed run). A tiny
random model with Llama-3's vocabulary stands in: none of these stages touches the weights. Its tokenizer is
a byte-level BPE of 32k tokens trained here on random words (no real tokenizer is at hand offline).

    .venv/bin/python bench/serving_host/serving_host.py [--json bench/serving_host/serving_host.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.engine import Engine  # noqa: E402
from services.engine.model.tiny import write_tiny  # noqa: E402
from services.gateway.inputs import ChunkRegistry, InputResolver  # noqa: E402
from services.rpc import tessera_pb2 as pb  # noqa: E402


def best_us(fn, number: int = 200, repeat: int = 7) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def worker_check(eng: Engine, preq: pb.PrefillRequest):
    """What the prefill worker does with a request's ids before the pass: its job's ids, the chunk ids, the
    engine's check. (Trees before Engine.check: tuples, then chunk_id of each chunk, then the engine's own
    validation of list copies, as services/prefill then did.)"""
    if hasattr(eng, "check"):
        return eng.check(tuple(c.ids for c in preq.chunks), preq.suffix, "tessera")
    chunks, suffix = tuple(tuple(c.ids) for c in preq.chunks), tuple(preq.suffix)
    ids = [eng.chunk_id(c) for c in chunks]
    return ids, eng._validate([list(c) for c in chunks], list(suffix), "tessera", 0.0)


class _Words:
    def __init__(self, rng: np.random.Generator, n: int = 5000) -> None:
        self.rng = rng
        letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
        self.words = ["".join(rng.choice(letters, rng.integers(2, 10))) for _ in range(n)]

    def choice(self, k: int) -> list[str]:
        return [self.words[i] for i in self.rng.integers(0, len(self.words), k)]


def bpe_tokenizer(path: Path) -> _Words:
    """Write a byte-level BPE (32k tokens) trained on random words to ``path``; returns its word source."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    words = _Words(np.random.default_rng(1))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator((" ".join(words.choice(200)) for _ in range(1000)),
                            trainers.BpeTrainer(vocab_size=32000, show_progress=False))
    tok.save(str(path))
    return words


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=6)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--suffix-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        write_tiny(d, vocab_size=128256, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                   num_kv_heads=1, head_dim=8)
        words = bpe_tokenizer(Path(d) / "tokenizer.json")
        eng = Engine.load(d)
        resolver = InputResolver(d, eng.fingerprint, ChunkRegistry())
        resolver_plain = InputResolver(d, eng.fingerprint, ChunkRegistry())
    if hasattr(resolver_plain, "text_cache"):
        resolver_plain.text_cache.max_tokens = 0  # every text tokenized every time
    docs = [" ".join(words.choice(args.chunk_tokens)) for _ in range(args.chunks)]  # ~a token a word
    text_req = pb.GenerateRequest(chunks=[pb.ChunkInput(text=t) for t in docs], suffix_text="why is that so?")
    print(f"text request: {[len(c) for c in resolver_plain.resolve(text_req).chunks]} tokens a document")
    rng = np.random.default_rng(0)
    req = pb.GenerateRequest(
        chunks=[pb.ChunkInput(tokens=pb.TokenIds(ids=rng.integers(0, 128000, args.chunk_tokens).tolist()))
                for _ in range(args.chunks)],
        suffix_tokens=pb.TokenIds(ids=rng.integers(0, 128000, args.suffix_tokens).tolist()))
    resolved = resolver.resolve(req)
    preq = pb.PrefillRequest(request_id="r", chunks=[pb.TokenIds(ids=c) for c in resolved.chunks],
                             suffix=resolved.suffix)
    stages = {
        "gateway resolve": lambda: resolver.resolve(req),
        "prefill request": lambda: pb.PrefillRequest(request_id="r", chunks=[pb.TokenIds(ids=c) for c in resolved.chunks],
                                                     suffix=resolved.suffix),
        "worker check": lambda: worker_check(eng, preq),
        "gateway resolve, text, every text tokenized": lambda: resolver_plain.resolve(text_req),
        "gateway resolve, text, documents seen before": lambda: resolver.resolve(text_req),
    }
    rows = {name: best_us(fn) for name, fn in stages.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    out = {"cpu": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "commit": commit, "request": f"{args.chunks} x {args.chunk_tokens} + {args.suffix_tokens} token ids",
           "us": rows}
    for name, us in rows.items():
        print(f"{name:46s} {us:8.1f} us")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
