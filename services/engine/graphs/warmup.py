"""Warming a serving engine up before it takes requests: every kernel compiled, every decode graph captured.

A worker's first request of a kind pays for what the engine builds on first use: Triton compiles a kernel
for each specialisation it meets (the skinny GEMMs per row bucket, the decode attention per split count), and
each static tail or decode graph is captured on its first shape. On an H100 the first decode step of a
batch bucket took 1.1-2.3 s against ~10 ms after it (bench/decode/README.md, ``first_step_ms``), and the first
``tessera`` prefill 1.8 s against 18.6 ms (bench/engine/README.md). In serving, a decode step stalls every
sequence of its batch: a closed loop of 32 clients saw requests of 9 s end to end where the median took 1.6 s
(bench/warmup/README.md), as the batch grew through buckets 1, 2, 4 .. 32 for the first time.

``warm_decode`` runs two decode steps in every batch bucket up to ``max_batch`` (for each sparse decode policy it
is given, Quest's and Retro's defaults unless told, then densely: the sparse kernels compile, and the dense graphs,
captured last, are the ones kept should the graph cache be full; then retrieval decode retrieving nothing, whose
graphs between attentions every retrieval request shares), ``warm_prefill`` one
prefill per pass a prefill worker runs (every mode; ``tessera`` at ratio 0 and at its recompute ratio). The
requests are made up: one context of ``context_tokens`` tokens as 512-token chunks (the decode sequences all
share one chunk, so a batch of 32 costs one context's KV), sized down to what the KV pool and the model's
length limit allow. Nothing stays behind: the sequences are released and what the passes added to the chunk
cache (chunks, prefixes, positioned replicas) is dropped. Each returns what it did and how long it took. On the CPU nothing is compiled or captured, so
the workers skip it there (``only_cuda``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import torch

from services.engine.kv.block_pool import PoolExhausted

log = logging.getLogger(__name__)

CHUNK_TOKENS = 512
SUFFIX_TOKENS = 64
DECODE_STEPS = 2  # per bucket: the first captures (and compiles), the second replays


def _context(eng, context_tokens: int, extra: int, spare_blocks: int, copies: int) -> int:
    """The made-up context's length: context_tokens, within the model's limit (``extra`` tokens after it) and
    half of the KV pool's free blocks once ``spare_blocks`` are set aside, the context held ``copies`` times
    (a mode's private copy, its cached chunks, a replica)."""
    limit = eng.cfg.max_position_embeddings
    if eng.cfg.sliding_window:
        limit = min(limit, eng.cfg.sliding_window)
    pool_tokens = max(0, eng.pool.num_free // 2 - spare_blocks) // copies * eng.block_size
    return max(0, min(context_tokens, limit - extra, pool_tokens))


def _chunks(eng, tokens: int, salt: int) -> list[list[int]]:
    """``tokens`` ids as 512-token chunks, a pattern no tokenizer makes from text (stepping through the
    vocabulary by a stride), distinct per ``salt``."""
    vocab = eng.cfg.vocab_size
    ids = [(7 + salt * 9973 + i * 101) % vocab for i in range(tokens)]
    return [ids[i:i + CHUNK_TOKENS] for i in range(0, tokens, CHUNK_TOKENS)]


def _drop(eng, before: set[str]) -> None:
    """Drop from the chunk cache every entry the warm-up added (chunks, prefixes, positioned replicas: none is
    pinned any more)."""
    for key in [k for k in eng.cache.keys() if k not in before]:
        entry = eng.cache.acquire(key)
        if entry is not None:
            eng.cache.release(entry)
            eng.cache.discard(entry)


def _finish(eng, done: dict, n: int, t0: float) -> dict:
    """``done`` with the context's length and the seconds since t0, once the GPU has run it all."""
    if eng.device.type == "cuda":
        torch.cuda.synchronize(eng.device)
    done["context_tokens"] = n
    done["seconds"] = time.perf_counter() - t0
    return done


def default_sparse_policies(eng) -> list:
    """Quest's and Retro's default policies, those this engine can serve (a model of few layers may not), and
    retrieval decode retrieving nothing (the static set alone: it captures the graphs between a retrieval step's
    attentions, graphs/layers.py, which every retrieval request shares, without an index to search)."""
    out = []
    for name, params in (("quest", {}), ("retro", {}), ("retrieval", {"retrieval_k": 0})):
        try:
            out.append(eng.decode_policy(name, **params))
        except ValueError:
            pass
    return out


def warm_decode(eng, max_batch: int, context_tokens: int = 4096, only_cuda: bool = True,
                progress: Callable[[str], None] = lambda _m: None, sparse: list | None = None) -> dict:
    """Two decode steps at each batch bucket up to ``max_batch`` over sequences of a ``context_tokens``-token
    context, under each of the ``sparse`` decode policies (None: ``default_sparse_policies``) and then densely ->
    {"batches": [...], "policies": [...], "context_tokens": n, "seconds": s} (empty batches when skipped;
    "stopped": why, when the KV pool could not hold the made-up batch)."""
    from services.engine.decode import DENSE
    from services.engine.graphs.decode import BATCH_BUCKETS

    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    done = {"batches": [], "policies": [], "context_tokens": 0, "seconds": 0.0}
    if only_cuda and eng.device.type != "cuda":
        return done
    sparse = default_sparse_policies(eng) if sparse is None else sparse
    # a policy with graphs between its attentions (retrieval) last: its start keeps each sequence's static set alone
    policies = [*(p for p in sparse if not p.layer_graphs), DENSE, *(p for p in sparse if p.layer_graphs)]
    t0 = time.perf_counter()
    # a batch size in each bucket the batcher can reach (a batch of 3 replays bucket 4's graph; past the
    # largest bucket a step runs eagerly)
    batches = sorted({b for b in BATCH_BUCKETS if b < max_batch} | {max_batch})
    # each sequence: the shared context, a one-token suffix (a private block) and its generated tokens (the first
    # sequence decodes in every bucket under every policy)
    steps = DECODE_STEPS * len(batches) * len(policies)
    n = _context(eng, context_tokens, 1 + steps, spare_blocks=batches[-1] * (2 + steps // eng.block_size), copies=1)
    chunks = _chunks(eng, n, 0)
    seqs, before = [], set(eng.cache.keys())
    try:
        for i in range(batches[-1]):
            suffix = [(11 + i * 31) % eng.cfg.vocab_size]
            c, s, ids, _scope = eng._validate(chunks, suffix, "tessera", 0.0, extra_tokens=steps)
            _, seq, _ = eng._prefill(c, s, "tessera", 0.0, ids=ids)
            seqs.append(seq)
        for policy in policies:
            for seq in seqs:
                eng.start_decode(seq, policy)
            for b in batches:
                progress(f"warm-up: {policy.name} decode steps of {b} sequence(s) over {n} tokens")
                for _ in range(DECODE_STEPS):
                    eng.decode_step(seqs[:b], [1] * b)
                if policy is DENSE:
                    done["batches"].append(b)
            if policy.layer_graphs:
                done["layer_graph_batches"] = list(batches)
            done["policies"].append(policy.name)
    except PoolExhausted as exc:  # a pool too small for the made-up batch: serve without the rest of it
        done["stopped"] = str(exc)
    finally:
        for seq in seqs:
            eng.release(seq)
        _drop(eng, before)
    return _finish(eng, done, n, t0)


def warm_prefill(eng, ratios: tuple[float, ...] = (0.0, 0.15), context_tokens: int = 3072, only_cuda: bool = True,
                 progress: Callable[[str], None] = lambda _m: None) -> dict:
    """One prefill per pass a prefill worker runs, whichever mode its clients ask for: ``full`` and ``prefix``,
    ``position_aware``, ``blend_copy`` at each ratio above 0, ``tessera`` at each ratio (the first reuse pass
    computes the chunks alone, the later ones find them resident) -> {"passes": [...], "context_tokens": n,
    "seconds": s, "stopped": why, when the KV pool could not hold a pass}."""
    done = {"passes": [], "context_tokens": 0, "seconds": 0.0}
    if only_cuda and eng.device.type != "cuda":
        return done
    t0 = time.perf_counter()
    # the context is held up to three times over (cached chunks, a positioned replica, a pass's private copy)
    n = _context(eng, context_tokens, SUFFIX_TOKENS, spare_blocks=-(-SUFFIX_TOKENS // eng.block_size), copies=3)
    chunks = _chunks(eng, n, 1)
    suffix = [(13 + j * 17) % eng.cfg.vocab_size for j in range(SUFFIX_TOKENS)]
    before = set(eng.cache.keys())
    try:
        passes = [("full", 0.0), ("prefix", 0.0), ("position_aware", 0.0),
                  *(("blend_copy", float(r)) for r in ratios if r > 0), *(("tessera", float(r)) for r in ratios)]
        for mode, ratio in passes:
            progress(f"warm-up: {mode} prefill at ratio {ratio} over {n} + {SUFFIX_TOKENS} tokens")
            eng.prefill(chunks, suffix, mode=mode, recompute_ratio=ratio)
            done["passes"].append(f"{mode}@{ratio}")
    except PoolExhausted as exc:
        done["stopped"] = str(exc)
    finally:
        _drop(eng, before)
    return _finish(eng, done, n, t0)


async def warm_up(name: str, warm, *args) -> dict | None:
    """A worker's start-up warm-up, ``warm(*args)`` off the event loop: its result, or None when it failed
    (logged: the worker serves without it, its first requests paying for what it would have built)."""
    try:
        done = await asyncio.to_thread(warm, *args)
    except Exception:  # noqa: BLE001 - an optimisation: never a reason not to serve
        log.warning("%s: warm-up failed; serving without it", name, exc_info=True)
        return None
    if "stopped" in done:
        log.warning("%s: warm-up stopped early (%s)", name, done["stopped"])
    return done
