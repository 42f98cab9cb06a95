"""Trace synthesis: Zipf popularity, distinct draws, positions, arrivals, lengths, hash ids."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from loadgen.trace import (BlockHasher, Chunk, LengthDist, SynthConfig, ZipfSampler,
                           arrival_times_ms, doc_token_ids, suffix_token_ids, synthesize)
from tests.loadgen.stats_helpers import chi2_critical, chi2_statistic


def _zipf_probs(n: int, alpha: float) -> np.ndarray:
    w = np.arange(1, n + 1, dtype=np.float64) ** -alpha
    return w / w.sum()


def test_with_replacement_draws_follow_zipf():
    trace = synthesize(SynthConfig(docs=300, alpha=1.1, chunks_per_request=10, requests=4000,
                                   with_replacement=True, seed=11))
    docs = np.array([c.doc for r in trace for c in r.chunks])
    counts = np.bincount(docs, minlength=300)
    stat, df = chi2_statistic(counts, _zipf_probs(300, 1.1))
    assert stat < chi2_critical(df), (stat, df)
    # The same counts are far from a neighbouring skew: the test has power.
    stat_wrong, df_wrong = chi2_statistic(counts, _zipf_probs(300, 1.0))
    assert stat_wrong > chi2_critical(df_wrong), (stat_wrong, df_wrong)


@pytest.mark.parametrize("rejection_draws", [64, 0], ids=["rejection", "gumbel-top-k"])
def test_distinct_sampling_matches_successive_sampling(rejection_draws):
    # Exact law of 2 distinct items by successive sampling: P{i,j} = p_i p_j (1/(1-p_i) + 1/(1-p_j)).
    n, alpha, trials = 5, 1.3, 20000
    p = _zipf_probs(n, alpha)
    sampler = ZipfSampler(n, alpha, rejection_draws=rejection_draws)
    rng = np.random.default_rng(5)
    pairs = list(itertools.combinations(range(n), 2))
    counts = np.zeros(len(pairs))
    for _ in range(trials):
        a, b = sampler.sample_distinct(rng, 2)
        assert a != b
        counts[pairs.index((min(a, b), max(a, b)))] += 1
    probs = np.array([p[i] * p[j] * (1 / (1 - p[i]) + 1 / (1 - p[j])) for i, j in pairs])
    assert probs.sum() == pytest.approx(1.0)
    stat, df = chi2_statistic(counts, probs)
    assert stat < chi2_critical(df), (stat, df)


def test_distinct_requests_put_popular_documents_at_every_position():
    k = 6
    trace = synthesize(SynthConfig(docs=200, alpha=1.5, chunks_per_request=k, requests=3000, seed=3))
    slots_of_top = []
    for r in trace:
        docs = [c.doc for c in r.chunks]
        assert len(set(docs)) == k
        slots_of_top += [i for i, d in enumerate(docs) if d == 0]
    # Document 0 is in almost every request, at a uniformly random slot.
    assert len(slots_of_top) > 0.9 * len(trace)
    stat, df = chi2_statistic(np.bincount(slots_of_top, minlength=k), np.full(k, 1 / k))
    assert stat < chi2_critical(df)


def test_gumbel_fallback_handles_a_very_light_tail():
    sampler = ZipfSampler(30, 3.0)  # all 30 items wanted: the last has p ~ 3e-5
    got = sampler.sample_distinct(np.random.default_rng(0), 30)
    assert sorted(got) == list(range(30))


def test_synthesis_is_deterministic_and_streams_are_independent():
    base = SynthConfig(docs=100, alpha=1.2, chunks_per_request=3, requests=50, seed=7,
                       doc_tokens=LengthDist.parse("uniform:10:900"))
    assert synthesize(base) == synthesize(base)
    faster = synthesize(SynthConfig(**{**{f: getattr(base, f) for f in base.__slots__}, "rate": 9.0}))
    # Only the arrival times change with the rate.
    assert [r.chunks for r in faster] == [r.chunks for r in synthesize(base)]
    assert [r.timestamp_ms for r in faster] != [r.timestamp_ms for r in synthesize(base)]


def test_requests_are_consistent():
    trace = synthesize(SynthConfig(docs=50, alpha=1.0, chunks_per_request=4, requests=200, seed=1,
                                   doc_tokens=LengthDist.parse("lognormal:300:200"),
                                   suffix_tokens=LengthDist.parse("uniform:0:40")))
    doc_len: dict[int, int] = {}
    for r in trace:
        assert r.input_length == r.chunk_tokens + r.suffix_tokens
        assert len(r.hash_ids) == -(-r.input_length // 512)
        for c in r.chunks:
            assert doc_len.setdefault(c.doc, c.tokens) == c.tokens  # a document has one length
    ts = [r.timestamp_ms for r in trace]
    assert ts[0] == 0 and ts == sorted(ts)


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrivals_have_the_rate_and_burstiness_asked_for(burstiness):
    t = arrival_times_ms(np.random.default_rng(2), 20001, rate=50.0, burstiness=burstiness)
    gaps = np.diff(t) / 1000.0
    assert gaps.mean() == pytest.approx(1 / 50.0, rel=0.05)
    # Gamma(shape=B): coefficient of variation 1/sqrt(B); 1 is Poisson.
    assert gaps.std() / gaps.mean() == pytest.approx(burstiness ** -0.5, rel=0.15)


def test_infinite_rate_sends_everything_at_once():
    assert not arrival_times_ms(np.random.default_rng(0), 5, float("inf"), 1.0).any()


@pytest.mark.parametrize("spec,mean", [("const:512", 512), ("512", 512), ("uniform:64:256", 160),
                                       ("normal:300:50", 300), ("lognormal:200:150", 200)])
def test_length_distributions(spec, mean):
    dist = LengthDist.parse(spec)
    x = dist.sample(np.random.default_rng(0), 20000, floor=1)
    assert x.dtype == np.int64 and x.min() >= 1
    assert x.mean() == pytest.approx(mean, rel=0.03)
    if dist.kind == "uniform":
        assert x.min() == 64 and x.max() == 256


@pytest.mark.parametrize("spec", ["zipf:3", "uniform:9:3", "normal:1", "const:-4", "const:x",
                                  "lognormal:0:1", "normal:nan:1"])
def test_bad_length_distributions_are_refused(spec):
    with pytest.raises(ValueError):
        LengthDist.parse(spec)


@pytest.mark.parametrize("kwargs", [dict(docs=3, chunks_per_request=4), dict(alpha=-1.0),
                                    dict(rate=0.0), dict(burstiness=0.0), dict(requests=0)])
def test_bad_synth_configs_are_refused(kwargs):
    with pytest.raises(ValueError):
        SynthConfig(**kwargs)


def test_hash_ids_are_prefix_chained_512_token_blocks():
    h = BlockHasher()
    a = h.hash_ids([Chunk(1, 512), Chunk(2, 256), Chunk(3, 256)], 10)      # blocks: [1] [2 3] [sfx]
    b = h.hash_ids([Chunk(1, 512), Chunk(2, 256), Chunk(3, 256)], 10)
    c = h.hash_ids([Chunk(1, 512), Chunk(3, 256), Chunk(2, 256)], 10)
    d = h.hash_ids([Chunk(2, 256), Chunk(1, 512), Chunk(3, 256)], 10)
    assert len(a) == 3
    assert a[:2] == b[:2] and a[2] != b[2]      # same prefix, private suffix block
    assert c[0] == a[0] and c[1] != a[1]         # same first block only
    assert not set(d) & set(a)                   # a different first chunk shares nothing
    assert h.hash_ids([Chunk(1, 300)], 0) != h.hash_ids([Chunk(1, 512)], 0)


def test_document_tokens_are_deterministic():
    a = doc_token_ids(42, 100, 32000, seed=1, low=3)
    assert np.array_equal(a, doc_token_ids(42, 100, 32000, seed=1, low=3))
    assert not np.array_equal(a, doc_token_ids(43, 100, 32000, seed=1, low=3))
    assert not np.array_equal(a, doc_token_ids(42, 100, 32000, seed=2, low=3))
    assert a.min() >= 3 and a.max() < 32000
    assert not np.array_equal(suffix_token_ids(42, 100, 32000, seed=1), doc_token_ids(42, 100, 32000, seed=1))
    with pytest.raises(ValueError):
        doc_token_ids(1, 10, vocab_size=5, low=5)
