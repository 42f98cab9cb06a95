"""Chunks seen before skip the conversion and the hash (KnownChunks), and are never read wrongly."""

from __future__ import annotations

import pytest
import torch

from services.engine.kv.request_ids import KnownChunks

from ..conftest import random_request


@pytest.mark.slow
def test_a_chunk_seen_before_gets_the_same_id_without_the_long_path(engine):
    chunks, suffix = random_request(31, lengths=(20, 33, 17))
    first = engine.check(chunks, suffix, "tessera")
    hits = engine.known_chunks.hits
    again = engine.check([list(c) for c in chunks], suffix, "tessera")  # equal lists, other objects
    assert engine.known_chunks.hits == hits + 3
    assert again.chunk_ids == first.chunk_ids == [engine.chunk_id(c) for c in chunks]
    as_tuples = engine.check([tuple(c) for c in chunks], suffix, "tessera")
    assert as_tuples.chunks == chunks and all(type(c) is list for c in as_tuples.chunks)
    assert as_tuples.chunk_ids == first.chunk_ids
    # a reordered request and one with a new chunk: ids by content, new ones hashed the long way
    new = [7, 8, 9]
    mixed = engine.check([chunks[2], new, chunks[0]], suffix, "tessera")
    assert mixed.chunk_ids == [engine.chunk_id(chunks[2]), engine.chunk_id(new), engine.chunk_id(chunks[0])]
    assert torch.equal(engine.prefill(chunks, suffix, recompute_ratio=0.0).logits,
                       engine.prefill(first, None, recompute_ratio=0.0).logits)


def test_an_id_equal_to_a_known_one_but_not_an_int_is_still_refused(engine):
    """Python counts 2.0 == 2 and hashes them alike: a list that differs from a known one only by a float
    must not hit it."""
    chunks, suffix = random_request(32, lengths=(9, 5))
    engine.check(chunks, suffix, "tessera")
    bad = list(chunks[1])
    bad[3] = float(bad[3])
    with pytest.raises(ValueError, match=f"token id {bad[3]!r} in chunk 1 is not an integer"):
        engine.check([chunks[0], bad], suffix, "tessera")


def test_a_list_changed_in_place_is_read_again(engine):
    chunks, suffix = random_request(33, lengths=(12, 6))
    before = engine.check(chunks, suffix, "tessera").chunk_ids
    chunks[0][4] = (chunks[0][4] + 1) % 256
    after = engine.check(chunks, suffix, "tessera").chunk_ids
    assert after[0] != before[0] and after[0] == engine.chunk_id(chunks[0]) and after[1] == before[1]


def test_bad_chunks_are_never_remembered(engine):
    chunks, suffix = random_request(34, lengths=(10,))
    outside = [1, 2, engine.cfg.vocab_size]
    for _ in range(2):  # refused the second time too: the first refusal kept nothing
        with pytest.raises(ValueError, match=f"token id {engine.cfg.vocab_size} in chunk 1 is outside"):
            engine.check([chunks[0], outside], suffix, "tessera")
    assert engine.known_chunks.get(engine.known_chunks.key(outside)) is None
    with pytest.raises(ValueError, match="suffix must hold"):
        engine.check(chunks, [], "tessera")
    assert engine.known_chunks.get(engine.known_chunks.key(chunks[0])) is None  # refused requests keep nothing


def test_the_memo_keeps_its_token_budget_least_recently_used_first():
    known = KnownChunks(max_tokens=10)
    a, b, c = (1, 2, 3, 4), (5, 6, 7), (8, 9, 10, 11)
    for ids, name in ((a, "a"), (b, "b")):
        known.put(known.key(ids), name)
    assert known.get(known.key(list(a))) == "a"  # a is now the most recent
    known.put(known.key(c), "c")  # 11 tokens: b, the least recent, goes
    assert known.tokens == 8 and len(known) == 2
    assert known.get(known.key(b)) is None and known.get(known.key(a)) == "a" and known.get(known.key(c)) == "c"
    known.put(known.key(tuple(range(11))), "too long")  # longer than the whole budget: not kept
    assert len(known) == 2
    assert known.key(torch.tensor(a)) is None and known.key(iter(a)) is None and known.key("abc") is None
    off = KnownChunks(max_tokens=0)
    assert off.key(a) is None
    with pytest.raises(ValueError, match="max_tokens"):
        KnownChunks(max_tokens=-1)
