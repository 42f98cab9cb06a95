"""Quest decode in the engine (services/engine/decode/quest.py): a budget covering every page equals dense decoding,
page bounds that are a chunk's own (computed once, the same wherever it is placed, after a store round trip and a
hand-off), private pages bounded as they grow, stats, mixed batches, and bad parameters refused by name. The
kernels themselves are checked against their twins in tests/kernels/test_sparse_decode.py."""

from __future__ import annotations

import pytest
import torch

from services.engine import Engine
from services.engine.decode import DENSE, QuestDecode, policy_for

from ..conftest import random_request


def _bounds_of(eng, blocks, layer):
    pool = eng.pool
    idx = torch.tensor(blocks)
    return pool.kmin[layer][idx].clone(), pool.kmax[layer][idx].clone()


def _true_bounds(k, n_tokens, bs):
    """k [L, Hkv, D] of a chunk laid densely from slot 0: per block, the min and max of its keys."""
    pages = []
    for start in range(0, n_tokens, bs):
        page = k[start:start + bs]
        pages.append((page.amin(0), page.amax(0)))
    return torch.stack([p[0] for p in pages]), torch.stack([p[1] for p in pages])


def test_a_budget_covering_every_page_generates_what_dense_does(tiny_dir):
    eng = Engine.load(tiny_dir)
    chunks, suffix = random_request(31, lengths=(40, 27, 33), suffix_len=6)
    dense = eng.generate(chunks, suffix, max_new_tokens=10, stop_token_ids=[])
    for dense_layers in (0, 2):
        stats = {}
        quest = eng.generate(chunks, suffix, max_new_tokens=10, stop_token_ids=[], decode="quest",
                             budget_tokens=4096, dense_layers=dense_layers, stats=stats)
        assert quest == dense
        assert stats["steps"] == 9 and stats["pages_read"] == stats["pages_visible"] > 0
    stats = {}
    tight = eng.generate(chunks, suffix, max_new_tokens=10, stop_token_ids=[], decode="quest", budget_tokens=16,
                         dense_layers=0, stats=stats)
    assert len(tight) == 10
    # one page per (sequence, KV head, layer) a step: the newest
    assert stats["pages_read"] == stats["steps"] * eng.cfg.num_layers * eng.cfg.num_kv_heads
    assert stats["pages_read"] < stats["pages_visible"]


def test_logits_of_a_full_budget_step_equal_dense_within_fp32(tiny_dir):
    eng = Engine.load(tiny_dir)
    chunks, suffix = random_request(32, lengths=(35, 50), suffix_len=5)
    out = []
    for policy in (DENSE, eng.decode_policy("quest", budget_tokens=4096, dense_layers=0)):
        _, h = eng.prefill_handoff(chunks, suffix)
        seq = eng.import_handoff(h, decode=policy)
        out.append(torch.stack([eng.decode_step([seq], [t])[0] for t in (5, 9, 11, 2)]))
        eng.release(seq)
    torch.testing.assert_close(out[1], out[0], rtol=1e-5, atol=1e-5)


def test_a_chunks_bounds_are_computed_once_and_are_its_own_wherever_it_is_placed(tiny_dir):
    """The chunk's pages are bounded by its first sparse decode, from its keys at chunk-local positions; a second
    request placing it elsewhere reuses them untouched; the bounds are exactly the per-page min/max of its KV."""
    eng = Engine.load(tiny_dir)
    shared = random_request(33, lengths=(45,))[0][0]
    first, _ = random_request(34, lengths=(20,))
    second, _ = random_request(35, lengths=(37, 11))
    quest = dict(decode="quest", budget_tokens=32, dense_layers=0, max_new_tokens=3, stop_token_ids=[])
    eng.generate(first + [shared], [1, 2, 3], **quest)
    cid = eng.chunk_id(shared)
    entry = eng.cache.acquire(cid)
    assert entry.bounded
    kv = eng.export_chunk(cid)
    before = [_bounds_of(eng, entry.blocks, layer) for layer in range(eng.cfg.num_layers)]
    for layer, (k, _) in enumerate(kv):
        lo, hi = _true_bounds(k, len(shared), eng.block_size)
        torch.testing.assert_close(before[layer][0], lo, rtol=0, atol=0)
        torch.testing.assert_close(before[layer][1], hi, rtol=0, atol=0)
    eng.pool.kmin[0][entry.blocks[0]] = 123.0          # were they recomputed, this would be overwritten
    eng.generate(second + [shared], [4, 5], **quest)    # placed at another offset
    assert eng.pool.kmin[0][entry.blocks[0]].eq(123.0).all()
    eng.cache.release(entry)


def test_a_chunks_bounds_survive_a_store_round_trip_and_a_hand_off(tiny_dir):
    """Bounds made on another engine from the chunk's KV as the store returns it (export, insert), and on a decode
    engine that took the request by hand-off, equal the first engine's bit for bit."""
    a, b, c = Engine.load(tiny_dir), Engine.load(tiny_dir), Engine.load(tiny_dir)
    chunks, suffix = random_request(36, lengths=(29, 40), suffix_len=4)
    quest = dict(decode="quest", budget_tokens=32, dense_layers=0)
    a.generate(chunks, suffix, max_new_tokens=2, stop_token_ids=[], **quest)
    for chunk in chunks:
        cid = a.chunk_id(chunk)
        b.insert_chunk(cid, chunk, a.export_chunk(cid))                 # as the store hands it back
    b.generate(chunks, suffix, max_new_tokens=2, stop_token_ids=[], **quest)
    _, handoff = a.prefill_handoff(chunks, suffix)
    seq = c.import_handoff(handoff, fetch=lambda cid: iter(a.export_chunk(cid)), **quest)
    for chunk in chunks:
        cid = a.chunk_id(chunk)
        ea, eb, ec = (e.cache.acquire(cid) for e in (a, b, c))
        assert ea.bounded and eb.bounded and ec.bounded
        for layer in range(a.cfg.num_layers):
            for x, y in ((_bounds_of(a, ea.blocks, layer), _bounds_of(b, eb.blocks, layer)),
                         (_bounds_of(a, ea.blocks, layer), _bounds_of(c, ec.blocks, layer))):
                assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
        for e, entry in ((a, ea), (b, eb), (c, ec)):
            e.cache.release(entry)
    c.release(seq)


def test_private_pages_are_bounded_over_what_they_hold_as_they_grow(tiny_dir):
    """The suffix's and the generated tokens' pages: after every step each private page's bounds are exactly the
    min and max of the keys its table entry shows."""
    eng = Engine.load(tiny_dir)
    chunks, suffix = random_request(37, lengths=(30,), suffix_len=21)
    _, h = eng.prefill_handoff(chunks, suffix)
    seq = eng.import_handoff(h, decode="quest", budget_tokens=32, dense_layers=0)
    bs = eng.block_size
    for step in range(bs + 3):                                # crosses into a second generated block
        eng.decode_step([seq], [step + 1])
        for layer in range(eng.cfg.num_layers):
            table = seq.layer_tables[layer]
            rows = [(int(b), int(m)) for b, m in zip(table.block_ids, table.masks) if int(b) in seq.private_blocks]
            rows += [(blk, (1 << min(bs, seq.gen_count - i * bs)) - 1) for i, blk in enumerate(seq.gen_blocks)]
            for block, mask in rows:
                keys = eng.pool.k[layer][block][[t for t in range(bs) if mask >> t & 1]]
                assert torch.equal(eng.pool.kmin[layer][block], keys.amin(0))
                assert torch.equal(eng.pool.kmax[layer][block], keys.amax(0))
    eng.release(seq)


def test_dense_and_quest_sequences_in_one_step_get_what_each_gets_alone(tiny_dir):
    eng = Engine.load(tiny_dir)
    quest = eng.decode_policy("quest", budget_tokens=32, dense_layers=1)
    requests = [random_request(seed, lengths=(30, 21), suffix_len=4) for seed in (41, 42, 43)]
    policies = [DENSE, quest, quest]
    alone = []
    for (chunks, suffix), policy in zip(requests, policies):
        _, h = eng.prefill_handoff(chunks, suffix)
        seq = eng.import_handoff(h, decode=policy)
        alone.append(torch.stack([eng.decode_step([seq], [t])[0] for t in (5, 6)]))
        eng.release(seq)
    seqs = []
    for (chunks, suffix), policy in zip(requests, policies):
        _, h = eng.prefill_handoff(chunks, suffix)
        seqs.append(eng.import_handoff(h, decode=policy))
    together = torch.stack([eng.decode_step(seqs, [t] * 3) for t in (5, 6)], 1)
    for want, got in zip(alone, together):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for seq in seqs:
        eng.release(seq)


def test_bad_quest_parameters_are_refused_by_name(engine):
    chunks, suffix = random_request(7)
    for kwargs, match in ((dict(budget_tokens=8), "budget_tokens must be at least one page"),
                          (dict(budget_tokens=0), "budget_tokens"),
                          (dict(dense_layers=-1), "dense_layers"),
                          (dict(dense_layers=99), "dense_layers must be at most"),
                          (dict(retro_window=2), "unexpected keyword argument 'retro_window'")):
        with pytest.raises((ValueError, TypeError), match=match):
            engine.generate(chunks, suffix, max_new_tokens=2, decode="quest", **kwargs)
    with pytest.raises(TypeError, match="takes no parameters"):
        policy_for("dense", budget_tokens=64)
    assert policy_for("quest") == QuestDecode(2048, 2) and engine.cache.resident_bytes == 0
