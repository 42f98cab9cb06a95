"""Synthetic RAG traces: Zipf document popularity, random chunk order, Poisson/bursty arrivals.

Document ``d`` (0-based) has popularity rank d+1: P(d) = (d+1)^-alpha / sum_{i<=N} i^-alpha.
A request holds K distinct documents drawn by popularity (successive sampling without
replacement: equivalent to drawing with replacement and skipping repeats) and then shuffled,
so a popular document lands at every position; or, with ``with_replacement``, K independent
draws (the setting of LazyAttention's closed form). Every random stream (document lengths,
selection, order, suffixes, outputs, arrivals) is its own child of the seed, so changing one
knob (say the rate) leaves the others' draws unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from loadgen.trace.dists import LengthDist
from loadgen.trace.model import BlockHasher, Chunk, TraceRequest


class ZipfSampler:
    """Finite Zipf over ``n`` items: item i (0-based) has probability ∝ (i+1)^-alpha."""

    def __init__(self, n: int, alpha: float, rejection_draws: int = 64) -> None:
        self.rejection_draws = rejection_draws     # per item wanted, before the O(n) fallback
        weights = np.arange(1, n + 1, dtype=np.float64) ** -alpha
        self.probs = weights / weights.sum()           # [n]
        self._cdf = np.cumsum(self.probs)
        self._cdf[-1] = 1.0                             # no draw may fall past the end

    def sample(self, rng: np.random.Generator, size: int | tuple[int, ...]) -> np.ndarray:
        """Independent draws (int64, any shape) by inverse CDF."""
        return np.searchsorted(self._cdf, rng.random(size), side="right").astype(np.int64)

    def sample_distinct(self, rng: np.random.Generator, k: int) -> list[int]:
        """k distinct items in successive-sampling order (draw, skip repeats).

        Draws in growing batches; when the tail is so light that this would take many draws,
        falls back to Gumbel top-k, which gives the same distribution in O(n).
        """
        seen: dict[int, None] = {}
        batch, drawn = 4 * k, 0
        while drawn < self.rejection_draws * k:
            for item in self.sample(rng, batch).tolist():
                seen.setdefault(item, None)
                if len(seen) == k:
                    return list(seen)
            drawn += batch
            batch *= 2
        keys = np.log(self.probs) + rng.gumbel(size=self.probs.size)
        top = np.argpartition(-keys, k - 1)[:k]
        return [int(i) for i in top[np.argsort(-keys[top])]]


@dataclass(frozen=True, slots=True)
class SynthConfig:
    """Everything ``tessera trace synth`` takes; checked once here."""

    docs: int = 1000
    alpha: float = 1.1
    chunks_per_request: int = 5
    doc_tokens: LengthDist = field(default_factory=lambda: LengthDist("const", (512.0,)))
    suffix_tokens: LengthDist = field(default_factory=lambda: LengthDist("const", (32.0,)))
    output_tokens: LengthDist = field(default_factory=lambda: LengthDist("const", (64.0,)))
    rate: float = 1.0                  # requests per second; math.inf: all arrive at t=0
    burstiness: float = 1.0            # gamma shape; 1 = Poisson, < 1 burstier, > 1 smoother
    requests: int = 1000
    seed: int = 0
    with_replacement: bool = False

    def __post_init__(self) -> None:
        if self.docs < 1 or self.requests < 1 or self.chunks_per_request < 0:
            raise ValueError("docs and requests must be >= 1, chunks-per-request >= 0")
        if not self.with_replacement and self.chunks_per_request > self.docs:
            raise ValueError(f"cannot draw {self.chunks_per_request} distinct documents from "
                             f"{self.docs}; lower --chunks-per-request or pass --with-replacement")
        if not math.isfinite(self.alpha) or self.alpha < 0:
            raise ValueError(f"alpha must be finite and >= 0, got {self.alpha}")
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 (inf for all at once), got {self.rate}")
        if not (math.isfinite(self.burstiness) and self.burstiness > 0):
            raise ValueError(f"burstiness must be finite and > 0, got {self.burstiness}")
        if self.seed < 0:
            raise ValueError("seed must be >= 0")

    def describe(self, alpha: str | None = None) -> str:
        """One line for reports; ``alpha`` replaces the alpha shown (e.g. a sweep's "α")."""
        order = "with replacement" if self.with_replacement else "distinct, shuffled"
        return (f"{self.requests} requests, {self.docs} docs, Zipf alpha={alpha or f'{self.alpha:g}'}, "
                f"{self.chunks_per_request} chunks/request ({order}), doc tokens "
                f"{self.doc_tokens.spec()}, suffix {self.suffix_tokens.spec()}, output "
                f"{self.output_tokens.spec()}, rate {self.rate:g}/s, burstiness "
                f"{self.burstiness:g}, seed {self.seed}")


def arrival_times_ms(rng: np.random.Generator, n: int, rate: float, burstiness: float) -> np.ndarray:
    """Arrival times in ms, first at 0, rounded to 1 µs.

    Inter-arrival gaps ~ Gamma(shape=burstiness, scale=1/(rate*burstiness)): mean 1/rate for
    every burstiness, exponential (Poisson arrivals) at 1, as ``vllm bench serve`` does.
    """
    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=max(n - 1, 0))
    return np.round(np.concatenate([[0.0], np.cumsum(gaps)]) * 1000.0, 3)


def synthesize(config: SynthConfig) -> list[TraceRequest]:
    """The trace ``config`` describes, deterministic in ``config.seed``."""
    c = config
    streams = np.random.SeedSequence(c.seed).spawn(6)
    r_len, r_pick, r_order, r_suffix, r_out, r_time = (np.random.default_rng(s) for s in streams)
    doc_len = c.doc_tokens.sample(r_len, c.docs, floor=1)
    zipf = ZipfSampler(c.docs, c.alpha)
    k = c.chunks_per_request
    if c.with_replacement:
        picks = zipf.sample(r_pick, (c.requests, k)).tolist()
    else:
        picks = []
        for _ in range(c.requests):
            chosen = zipf.sample_distinct(r_pick, k) if k else []
            picks.append([chosen[i] for i in r_order.permutation(k)])
    suffix = c.suffix_tokens.sample(r_suffix, c.requests, floor=0).tolist()
    output = c.output_tokens.sample(r_out, c.requests, floor=1).tolist()
    times = arrival_times_ms(r_time, c.requests, c.rate, c.burstiness).tolist()
    hasher, trace = BlockHasher(), []
    for i in range(c.requests):
        chunks = tuple(Chunk(doc, int(doc_len[doc])) for doc in picks[i])
        n_in = sum(ch.tokens for ch in chunks) + suffix[i]
        trace.append(TraceRequest(
            timestamp_ms=times[i], input_length=n_in, output_length=output[i],
            hash_ids=hasher.hash_ids(chunks, suffix[i]), chunks=chunks, suffix_tokens=suffix[i]))
    return trace
