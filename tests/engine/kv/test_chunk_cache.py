"""Shared chunk KV is allocated once and reused at any position; the cache honours its budget."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from services.engine import Engine
from services.engine.kv.block_pool import PoolExhausted
from services.engine.kv.chunk_cache import chunk_id
from services.engine.kv.chunk_ids import chunk_ids_of

from ..conftest import random_request


def test_hundred_requests_over_five_chunks_allocate_each_chunk_once(engine):
    chunks, _ = random_request(11, lengths=(20, 33, 17, 40, 9))
    rng = random.Random(0)
    free_before = engine.pool.num_free
    chunk_blocks = sum(-(-len(c) // engine.block_size) for c in chunks)
    seen: set[int] = set()
    for i in range(100):
        order = rng.sample(range(5), k=rng.randint(2, 5))
        new = [j for j in order if j not in seen]
        suffix = [rng.randrange(256) for _ in range(rng.randint(1, 12))]
        r = engine.prefill([chunks[j] for j in order], suffix, mode="tessera", recompute_ratio=0.15)
        # a chunk is computed the first time it is seen and never again, wherever it sits
        assert r.stats.chunk_misses == len(new) and r.stats.chunk_hits == len(order) - len(new)
        assert r.stats.chunk_tokens_computed == sum(len(chunks[j]) for j in new)
        seen.update(order)
        assert r.stats.private_blocks_allocated > 0
    # afterwards the pool holds exactly the five chunks' blocks: private blocks all came back
    assert len(engine.cache) == 5
    assert free_before - engine.pool.num_free == chunk_blocks
    stats_hits = engine.prefill(chunks, [1, 2, 3], mode="tessera").stats
    assert stats_hits.chunk_hits == 5 and stats_hits.chunk_misses == 0
    assert stats_hits.shared_blocks_allocated == 0 and stats_hits.chunk_tokens_computed == 0


def test_later_requests_prefill_no_chunk(engine):
    chunks, suffix = random_request(12, lengths=(20, 33, 17, 40, 9))
    engine.prefill(chunks, suffix, mode="tessera")
    for perm in itertools.islice(itertools.permutations(range(5)), 1, 30):
        s = engine.prefill([chunks[j] for j in perm], suffix, mode="tessera", recompute_ratio=0.15).stats
        assert (s.chunk_hits, s.chunk_misses, s.chunk_tokens_computed, s.shared_blocks_allocated) == (5, 0, 0, 0)


def test_position_aware_keeps_a_replica_per_position(engine):
    a, b = random_request(13, lengths=(20, 20))[0]
    s1 = engine.prefill([a, b], [5], mode="position_aware", recompute_ratio=0).stats
    s2 = engine.prefill([b, a], [5], mode="position_aware", recompute_ratio=0).stats
    s3 = engine.prefill([a, b], [6], mode="position_aware", recompute_ratio=0).stats
    assert (s1.chunk_misses, s2.chunk_misses, s3.chunk_hits) == (2, 2, 2)
    assert len(engine.cache) == 4
    t = engine.prefill([b, a], [5], mode="tessera", recompute_ratio=0).stats
    t2 = engine.prefill([a, b], [5], mode="tessera", recompute_ratio=0).stats
    assert (t.chunk_misses, t2.chunk_hits) == (2, 2)


def test_cache_evicts_lru_within_budget(tiny_dir):
    eng = Engine.load(tiny_dir, kv_cache_bytes=64 * 32768, chunk_cache_bytes=6 * 32768)  # 6 blocks of cache
    chunks, _ = random_request(14, lengths=(32, 32, 32, 32))  # 2 blocks each
    for c in chunks[:3]:
        eng.prefill([c], [1], mode="tessera")
    assert len(eng.cache) == 3 and eng.cache.resident_bytes <= eng.cache.budget_bytes
    eng.prefill([chunks[0]], [1], mode="tessera")          # touch chunk 0: chunk 1 is now the oldest
    eng.prefill([chunks[3]], [1], mode="tessera")          # needs room: evicts chunk 1
    keys = set(eng.cache.keys())
    assert eng.chunk_id(chunks[1]) not in keys
    assert {eng.chunk_id(chunks[i]) for i in (0, 2, 3)} <= keys
    assert eng.cache.evictions == 1 and eng.cache.resident_bytes <= eng.cache.budget_bytes


def test_pinned_chunks_overflow_the_budget_only_while_in_flight(tiny_dir):
    eng = Engine.load(tiny_dir, kv_cache_bytes=10 * 32768, chunk_cache_bytes=4 * 32768)
    chunks, suffix = random_request(15, lengths=(32, 32, 32))
    # 6 chunk blocks do not fit a 4-block cache, but the pool has them: the request is served
    ref = Engine.load(tiny_dir).prefill(chunks, suffix, mode="tessera").logits
    assert torch.allclose(eng.prefill(chunks, suffix, mode="tessera").logits, ref, atol=1e-5)
    assert eng.cache.overflows >= 1 and eng.cache.resident_bytes <= eng.cache.budget_bytes  # trimmed on release
    assert all(e.refs == 0 for e in eng.cache._entries.values())
    assert eng.pool.num_free + sum(len(e.blocks) for e in eng.cache._entries.values()) == eng.pool.usable_blocks
    # a request past the whole pool fails cleanly and leaves the cache unharmed
    big, _ = random_request(16, lengths=(64, 64, 64))
    with pytest.raises(PoolExhausted):
        eng.prefill(big, suffix, mode="tessera")
    assert all(e.refs == 0 for e in eng.cache._entries.values())
    assert eng.pool.num_free + sum(len(e.blocks) for e in eng.cache._entries.values()) == eng.pool.usable_blocks
    out = eng.prefill(chunks[:2], suffix, mode="tessera")  # still serves what fits
    assert torch.isfinite(out.logits).all()


def test_request_chunk_ids_are_the_chunk_ids_the_cache_keys_by(engine):
    """The ids a request's validation computes from its one int64 array equal chunk_id of each chunk, from
    lists, tuples, numpy arrays and tensors alike, and the chunks come back as lists of Python ints."""
    chunks, suffix = random_request(11, lengths=(5, 17, 1))
    forms = [chunks, [tuple(c) for c in chunks], [np.asarray(c, dtype=np.int32) for c in chunks],
             [torch.tensor(c) for c in chunks], [iter(c) for c in chunks]]
    for form in forms:
        got, sfx, ids, _ = engine._validate(form, torch.tensor(suffix), "tessera", 0.0)
        assert got == chunks and sfx == suffix
        assert all(type(t) is int for c in got for t in c) and all(type(t) is int for t in sfx)
        assert ids == [chunk_id(engine.fingerprint, c) for c in chunks] == [engine.chunk_id(c) for c in chunks]
    flat = np.concatenate([np.asarray(c, dtype=np.int64) for c in chunks])
    assert chunk_ids_of("fp", flat, [len(c) for c in chunks]) == [chunk_id("fp", c) for c in chunks]
    engine.prefill(chunks, suffix, mode="tessera", recompute_ratio=0.0)
    assert all(i in engine.cache for i in ids)
    with pytest.raises(ValueError, match=f"token id {2 ** 70} in chunk 1"):  # past int64: named all the same
        engine._validate([chunks[0], [1, 2 ** 70]], suffix, "tessera", 0.0)


def test_a_checked_request_serves_the_prefill_calls(engine):
    """Engine.check reads a request's ids once (a serving worker needs the chunk ids first): the prefill
    calls take the CheckedRequest in place of (chunks, suffix) with the same result, and refuse one checked
    for another mode, extra token count or suffix, by name."""
    chunks, suffix = random_request(12, lengths=(9, 4))
    req = engine.check(chunks, suffix, "tessera")
    assert req.chunk_ids == [engine.chunk_id(c) for c in chunks] and req.suffix == suffix
    want = engine.prefill(chunks, suffix, mode="tessera", recompute_ratio=0.3).logits
    assert torch.equal(engine.prefill(req, None, mode="tessera", recompute_ratio=0.3).logits, want)
    res, handoff = engine.prefill_handoff(req, None, mode="tessera", recompute_ratio=0.3)
    assert torch.equal(res.logits, want) and handoff is not None
    with pytest.raises(ValueError, match="checked for mode 'tessera'.*used for mode 'full'"):
        engine.prefill(req, None, mode="full")
    with pytest.raises(ValueError, match="extra tokens"):
        engine.prefill_handoff(req, None, mode="tessera", extra_tokens=4)
    with pytest.raises(ValueError, match="suffix=None"):
        engine.prefill(req, suffix, mode="tessera")
    with pytest.raises(ValueError, match="recompute_ratio"):
        engine.prefill(req, None, mode="tessera", recompute_ratio=2.0)
    bare = engine.check(chunks, suffix, "full", with_chunk_ids=False)
    assert bare.chunk_ids is None
    assert torch.equal(engine.prefill(bare, None, mode="full").logits, engine.prefill(chunks, suffix, mode="full").logits)
    with pytest.raises(ValueError, match="token id 999999 in chunk 1"):
        engine.check([chunks[0], [999999]], suffix)
