"""The cache simulator: replay a trace's chunk accesses against one reuse policy.

Hit ratio is over chunk tokens (suffixes are private and never cached). A chunk is its
tokens: (document, length), as the cluster names a chunk by a hash of its token ids. A request
is served as the cluster serves it (``served_chunks``): one of chunks only has its last
chunk's last token computed privately, a chunk token that is never a hit. The dynamic
policies differ only in what a cached entry is keyed by, i.e. which later uses it serves:

  prefix          the chunk *and everything before it* (a prefix-tree node): a request
                  reuses only its longest cached run of leading chunks.
  position_aware  (chunk, start position in the prompt): a replica per position, as
                  Block-Attention / PromptCache keep one (RoPE baked into the keys).
  tessera         the chunk alone: one position-agnostic copy serves every position.

Chunks of a request are looked up in prompt order; a miss computes the chunk and inserts
it (prefix: every chunk after the first miss is recomputed too). So an unlimited budget
misses exactly once per distinct key: the compulsory-miss bound.

The static oracles know how often each key is used in the trace and hold the most used
keys that fit the budget from the start, never evicting (keys as above):
  oracle_static_agnostic  a chunk, one copy each;
  oracle_static_aware     a (chunk, start position) pair: a copy per pair the trace has. When
                          every chunk takes D positions about equally often that is about
                          floor(C/D) chunks (LazyAttention's closed form); when each chunk has
                          one position (Mooncake's prefix-chained blocks), agnostic's figure.
A held key still misses its first use: someone computes it once (a compulsory miss), so an
unlimited oracle scores what the matching dynamic policy does with an unlimited budget.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Hashable, Sequence

from loadgen.sim.caches import make_cache
from loadgen.sim.shapes import ModelShape
from loadgen.trace.model import Chunk, TraceRequest, served_chunks

DYNAMIC_POLICIES = ("prefix", "position_aware", "tessera")
ORACLE_POLICIES = ("oracle_static_agnostic", "oracle_static_aware")
POLICIES = DYNAMIC_POLICIES + ORACLE_POLICIES


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulation: a policy, its eviction (dynamic policies) and a budget in bytes."""

    policy: str
    budget_bytes: float            # math.inf for unlimited
    shape: ModelShape
    eviction: str = "lru"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; use one of {', '.join(POLICIES)}")
        if not self.budget_bytes >= 0:
            raise ValueError(f"budget must be >= 0 bytes, got {self.budget_bytes}")


@dataclass(frozen=True, slots=True)
class SimResult:
    """What one simulation measured; ``hit_ratio`` = hit_tokens / chunk_tokens."""

    policy: str
    eviction: str
    model_shape: str
    kv_bytes_per_token: int
    budget_bytes: float
    requests: int
    chunk_accesses: int
    chunk_hits: int
    chunk_tokens: int
    hit_tokens: int
    hit_ratio: float
    insertions: int                # entries inserted (static: held); unlimited: the distinct keys
    inserted_bytes: int
    evicted_bytes: int
    evictions: int
    resident_bytes: int            # held at the end
    peak_bytes: int

    def to_json(self) -> dict:
        out = asdict(self)
        out["budget_bytes"] = None if math.isinf(self.budget_bytes) else int(self.budget_bytes)
        return out


def cache_keys(chunks: Sequence[Chunk], policy: str, chain: dict[tuple, int]) -> list[Hashable]:
    """The cache key of each of ``chunks`` (a prompt's, in order) under a dynamic policy (see
    the module docstring). ``chain`` interns prefix-tree nodes across calls; keep one per cache.
    """
    if policy == "tessera":
        return [(c.doc, c.tokens) for c in chunks]
    keys, node, start = [], 0, 0
    for c in chunks:
        if policy == "position_aware":
            keys.append((c.doc, c.tokens, start))
        else:                                   # prefix: intern (parent node, chunk) -> node
            node = chain.setdefault((node, c.doc, c.tokens), len(chain) + 1)
            keys.append(node)
        start += c.tokens
    return keys


def _simulate_dynamic(trace: Sequence[TraceRequest], cfg: SimConfig, progress=None) -> SimResult:
    bpt = cfg.shape.kv_bytes_per_token
    cache = make_cache(cfg.eviction, cfg.budget_bytes)
    chain: dict[tuple[int, int], int] = {}
    accesses = hits = tokens = hit_tokens = inserted = inserted_bytes = 0
    prefix_only = cfg.policy == "prefix"
    for req in trace:
        cached, private = served_chunks(req.chunks, req.suffix_tokens)
        tokens += private
        broken = False
        for key, c in zip(cache_keys(cached, cfg.policy, chain), cached):
            accesses += 1
            tokens += c.tokens
            if cache.lookup(key):
                if not broken:
                    hits += 1
                    hit_tokens += c.tokens
                # prefix after a miss: recomputed, but the cached copy stays (and is touched)
            else:
                broken = prefix_only
                if cache.insert(key, c.tokens * bpt):
                    inserted += 1
                    inserted_bytes += c.tokens * bpt
        if progress is not None:
            progress()
    return SimResult(
        cfg.policy, cfg.eviction, cfg.shape.name, bpt, cfg.budget_bytes, len(trace), accesses,
        hits, tokens, hit_tokens, hit_tokens / tokens if tokens else 0.0, inserted,
        inserted_bytes, cache.evicted_bytes, cache.evictions, cache.used, cache.peak)


def _simulate_oracle(trace: Sequence[TraceRequest], cfg: SimConfig) -> SimResult:
    bpt = cfg.shape.kv_bytes_per_token
    keyed_as = "position_aware" if cfg.policy == "oracle_static_aware" else "tessera"
    uses: Counter[Hashable] = Counter()
    size: dict[Hashable, int] = {}
    for req in trace:
        cached, _ = served_chunks(req.chunks, req.suffix_tokens)
        for key, c in zip(cache_keys(cached, keyed_as, {}), cached):
            uses[key] += 1
            size[key] = c.tokens
    held: set[Hashable] = set()
    used = 0
    # Most used first (ties: lower key); stop at the first that does not fit: top-C.
    for key, _ in sorted(uses.items(), key=lambda kv: (-kv[1], kv[0])):
        cost = size[key] * bpt
        if used + cost > cfg.budget_bytes:
            break
        held.add(key)
        used += cost
    accesses = hits = tokens = hit_tokens = 0
    computed: set[Hashable] = set()     # held keys past their first (compulsory) miss
    for req in trace:
        cached, private = served_chunks(req.chunks, req.suffix_tokens)
        tokens += private
        for key, c in zip(cache_keys(cached, keyed_as, {}), cached):
            accesses += 1
            tokens += c.tokens
            if key in computed:
                hits += 1
                hit_tokens += c.tokens
            elif key in held:
                computed.add(key)
    return SimResult(
        cfg.policy, "static", cfg.shape.name, bpt, cfg.budget_bytes, len(trace), accesses, hits,
        tokens, hit_tokens, hit_tokens / tokens if tokens else 0.0, len(held), used,
        0, 0, used, used)


def simulate(trace: Sequence[TraceRequest], cfg: SimConfig, progress=None) -> SimResult:
    """Run ``cfg`` over ``trace``; ``progress()`` (optional) is called once per request."""
    if cfg.policy in ORACLE_POLICIES:
        return _simulate_oracle(trace, cfg)
    return _simulate_dynamic(trace, cfg, progress)


def closed_form_ratio(capacity_docs: int, positions: int, alpha: float) -> float:
    """LazyAttention's H_agnostic / H_aware = sum_{i<=C} i^-a / sum_{i<=floor(C/D)} i^-a."""
    if capacity_docs < positions:
        raise ValueError("the ratio needs C >= D (the aware cache must hold one document)")
    h = lambda n: math.fsum(i ** -alpha for i in range(1, n + 1))  # noqa: E731
    return h(capacity_docs) / h(capacity_docs // positions)
