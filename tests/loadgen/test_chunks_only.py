"""Requests of chunks only (every plain Mooncake line): the simulator and the fake replay target
serve them as the cluster does (the last chunk's last token computed privately, never a hit), and
the two tools agree on every request of a trace."""

from __future__ import annotations

import math

import pytest

from loadgen.replay import ReplayConfig, replay
from loadgen.replay.fake import FakeTarget, FakeTargetConfig, VirtualClock
from loadgen.sim import ModelShape, SimConfig, simulate
from loadgen.trace import Chunk, LengthDist, SynthConfig, parse_lines, served_chunks, synthesize

SHAPE = ModelShape.from_name("llama3-8b")
ROOMY = FakeTargetConfig(gpu_tokens=10**9, dram_tokens=10**9)

# A; A again; A's blocks and one more (block 1 now whole, not A's last); two one-token requests.
MOONCAKE = parse_lines([
    '{"timestamp": 0, "input_length": 1024, "output_length": 2, "hash_ids": [0, 1]}',
    '{"timestamp": 1, "input_length": 1024, "output_length": 2, "hash_ids": [0, 1]}',
    '{"timestamp": 2, "input_length": 1300, "output_length": 2, "hash_ids": [0, 1, 2]}',
    '{"timestamp": 3, "input_length": 1, "output_length": 2, "hash_ids": [3]}',
    '{"timestamp": 4, "input_length": 1, "output_length": 2, "hash_ids": [3]}',
])
# Per request: chunk tokens not computed. The repeat of A hits all but its private last token; the
# third request's block 1 is another chunk than A's cached 511 tokens of it; one-token requests
# are their private token alone.
MOONCAKE_HITS = [0, 1023, 512, 0, 0]


def test_a_request_of_chunks_only_computes_its_last_token_privately():
    assert served_chunks([Chunk(5, 512), Chunk(6, 100)], 0) == ((Chunk(5, 512), Chunk(6, 99)), 1)
    assert served_chunks([Chunk(5, 512), Chunk(6, 1)], 0) == ((Chunk(5, 512),), 1)
    assert served_chunks([Chunk(5, 512)], 3) == ((Chunk(5, 512),), 0)     # the suffix ends it


@pytest.mark.parametrize("policy", ["prefix", "position_aware", "tessera"])
def test_the_simulator_never_counts_the_private_token_as_a_hit(policy):
    r = simulate(MOONCAKE, SimConfig(policy, math.inf, SHAPE))
    assert r.chunk_tokens == sum(q.input_length for q in MOONCAKE)
    assert r.hit_tokens == sum(MOONCAKE_HITS)


@pytest.mark.parametrize("mode", ["prefix", "position_aware", "blend_copy", "tessera"])
def test_the_fake_target_never_counts_the_private_token_as_a_hit(mode):
    clock = VirtualClock()
    run = replay(MOONCAKE, FakeTarget(ROOMY, clock), ReplayConfig(mode=mode, concurrency=1), clock=clock)
    assert all(r.ok for r in run.records)
    assert [r.chunk_tokens - r.tier_tokens["computed"] for r in run.records] == MOONCAKE_HITS
    assert [sum(r.tier_tokens.values()) for r in run.records] == [q.input_length for q in MOONCAKE]


def test_the_fake_target_refuses_an_empty_request_as_the_cluster_does():
    trace = parse_lines(['{"timestamp": 0, "input_length": 0, "output_length": 2, "hash_ids": []}'])
    clock = VirtualClock()
    (rec,) = replay(trace, FakeTarget(ROOMY, clock), ReplayConfig(concurrency=1), clock=clock).records
    assert not rec.ok and "empty request" in rec.error


@pytest.mark.parametrize("mode,policy", [("prefix", "prefix"), ("position_aware", "position_aware"),
                                         ("tessera", "tessera"), ("blend_copy", "tessera")])
def test_simulator_and_fake_target_agree_request_by_request(mode, policy):
    # Suffixes of 0 to 2 tokens: a third of the requests are chunks only; documents of 1 to 40
    # tokens, so some last chunks are one token long.
    synth = synthesize(SynthConfig(docs=30, alpha=1.2, chunks_per_request=3, requests=300, seed=3,
                                   doc_tokens=LengthDist.parse("uniform:1:40"),
                                   suffix_tokens=LengthDist.parse("uniform:0:2")))
    assert 50 < sum(r.suffix_tokens == 0 for r in synth) < 250
    for trace in (synth, MOONCAKE):
        clock = VirtualClock()
        run = replay(trace, FakeTarget(ROOMY, clock), ReplayConfig(mode=mode, concurrency=1), clock=clock)
        fake_hits = [r.chunk_tokens - r.tier_tokens["computed"] for r in run.records]
        sim_hits = [simulate(trace[:i + 1], SimConfig(policy, math.inf, SHAPE)).hit_tokens
                    for i in range(len(trace))]
        assert fake_hits == [b - a for a, b in zip([0] + sim_hits, sim_hits)]


def test_a_chunk_token_missing_from_a_targets_stats_is_not_a_hit():
    # A target that reports the private last token as suffix, not as a computed chunk token.
    from loadgen.replay import RequestRecord, summarize
    from loadgen.replay.plots import hit_ratio_series
    from loadgen.replay.runner import ReplayRun

    rec = RequestRecord(0, "r0", "tessera", 0.0, 0.0, 0.1, 0.2, (), 1024, 1024, 2,
                        {"gpu": 1023, "computed": 0})
    assert summarize(ReplayRun("tessera", (rec,), 1.0)).hit_ratio == pytest.approx(1023 / 1024)
    rec = RequestRecord(0, "r0", "tessera", 0.0, 0.0, 0.1, 0.2, (), 1024, 1024, 2, {"gpu": 1000})
    assert summarize(ReplayRun("tessera", (rec,), 1.0)).hit_ratio == pytest.approx(1000 / 1024)
    _, series = hit_ratio_series(ReplayRun("tessera", (rec,), 1.0), bins=1)
    assert series.tolist() == pytest.approx([1000 / 1024])
