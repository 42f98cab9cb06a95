"""RetroAttention in the engine (services/engine/decode/retro.py): a window of 1 is Quest, a budget covering every
page is dense, a past query's corrected output is attention over the union of the pages it has seen, corrections
re-embed into private blocks only, mixed batches equal each sequence alone, bad windows are refused by name."""

from __future__ import annotations

import pytest
import torch

from kernels import sparse
from services.engine import Engine
from services.engine.decode import DENSE, RetroDecode, policy_for

from ..conftest import random_request

LONG = dict(lengths=(40, 36, 44, 29), suffix_len=5)


def _decode(eng, request, policy, tokens):
    _, h = eng.prefill_handoff(*request)
    seq = eng.import_handoff(h, decode=policy)
    logits = torch.stack([eng.decode_step([seq], [t])[0] for t in tokens])
    return seq, logits


def test_a_window_of_one_is_quest(tiny_dir):
    eng = Engine.load(tiny_dir)
    chunks, suffix = random_request(51, **LONG)
    args = dict(max_new_tokens=24, stop_token_ids=[], budget_tokens=48, dense_layers=1)
    quest_stats, retro_stats = {}, {}
    quest = eng.generate(chunks, suffix, decode="quest", stats=quest_stats, **args)
    retro = eng.generate(chunks, suffix, decode="retro", retro_window=1, stats=retro_stats, **args)
    assert retro == quest and retro_stats == quest_stats and retro_stats["pages_corrected"] == 0
    tokens = list(range(3, 15))
    s1, l1 = _decode(eng, (chunks, suffix), eng.decode_policy("quest", budget_tokens=48, dense_layers=1), tokens)
    s2, l2 = _decode(eng, (chunks, suffix), eng.decode_policy("retro", budget_tokens=48, dense_layers=1,
                                                               retro_window=1), tokens)
    assert torch.equal(l1, l2) and not s2.past
    eng.release(s1)
    eng.release(s2)


def test_a_budget_covering_every_page_is_dense(tiny_dir):
    eng = Engine.load(tiny_dir)
    request = random_request(52, **LONG)
    tokens = list(range(7, 27))
    s1, dense = _decode(eng, request, DENSE, tokens)
    s2, retro = _decode(eng, request, eng.decode_policy("retro", budget_tokens=4096, dense_layers=0,
                                                         retro_window=4), tokens)
    torch.testing.assert_close(retro, dense, rtol=1e-5, atol=1e-5)
    assert s2.decode_stats.pages_corrected == 0 and len(s2.past) == 3
    eng.release(s1)
    eng.release(s2)
    assert eng.generate(*request, max_new_tokens=12, stop_token_ids=[], decode="retro", budget_tokens=4096,
                        retro_window=3) == eng.generate(*request, max_new_tokens=12, stop_token_ids=[])


def test_a_past_querys_output_is_attention_over_every_page_it_has_seen(tiny_dir):
    """At the first sparse layer (whose K/V nothing overwrites), each past token's cached output equals its query's
    attention over the union of its own step's pages and those of every later step that existed at its step."""
    eng = Engine.load(tiny_dir)
    w = 5
    policy = eng.decode_policy("retro", budget_tokens=32, dense_layers=1, retro_window=w)
    seq, _ = _decode(eng, random_request(53, **LONG), policy, list(range(2, 14)))
    assert len(seq.past) == w - 1 and seq.decode_stats.pages_corrected > 0
    layer = policy.dense_layers
    first_pos = seq.next_pos - seq.gen_count                                  # position of the first generated token
    grew = 0
    for j, token in enumerate(seq.past):
        table = _table_at(eng, seq, layer, token.pos - first_pos + 1)          # what the token's own step showed
        later = seq.past[j:]
        pages = torch.cat([t.sel[0] for t in later], -1)                      # [Hkv, n*K]
        union = [sorted({int(p) for p in row if 0 <= int(p) < int(token.entries[0])}) for row in pages]
        grew += sum(len(u) for u in union) > sum(int((token.sel[0][h] >= 0).sum()) for h in range(len(union)))
        k = max(len(u) for u in union)
        sel = torch.full((1, len(union), k), -1, dtype=torch.int32)
        for h, u in enumerate(union):
            sel[0, h, :len(u)] = torch.tensor(u, dtype=torch.int32)
        count = torch.tensor([[len(u) for u in union]], dtype=torch.int32)
        want, want_lse = sparse.sparse_decode_attention(
            token.q[0][None], eng.pool.k[layer], eng.pool.v[layer], table.block_ids, table.offsets, table.masks,
            sel, count, eng.forward.model.inv_freq, eng.forward.model.scale)
        torch.testing.assert_close(token.out[0], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(token.lse[0], want_lse[0], rtol=1e-5, atol=1e-5)
    assert grew, "no past query saw a page beyond its own step's: the check above compared nothing new"
    eng.release(seq)


def _table_at(eng, seq, layer, gen_count):
    """A sequence's table at one layer when it had generated ``gen_count`` tokens: its prefill entries, then the
    generated blocks that held them."""
    from services.engine.kv.block_table import BlockTable

    bs = eng.block_size
    blocks = seq.gen_blocks[:-(-gen_count // bs)]
    table = BlockTable.cat([seq.layer_tables[layer], BlockTable.for_run(blocks, gen_count, bs, 0, eng.device)])
    return table


def test_corrections_overwrite_private_blocks_only(tiny_dir):
    """Retro changes the K/V of past generated tokens above the first sparse layer (against Quest on the same
    tokens) and never writes a shared chunk's block."""
    eng = Engine.load(tiny_dir)
    request = random_request(54, **LONG)
    tokens = list(range(4, 20))
    chunk_ids = [eng.chunk_id(c) for c in request[0]]
    s1, _ = _decode(eng, request, eng.decode_policy("quest", budget_tokens=32, dense_layers=1), tokens)
    entries = [eng.cache.acquire(cid) for cid in chunk_ids]
    shared = [torch.cat([eng.pool.k[i][e.blocks] for e in entries]).clone() for i in range(eng.cfg.num_layers)]
    s2, _ = _decode(eng, request, eng.decode_policy("retro", budget_tokens=32, dense_layers=1, retro_window=3), tokens)
    assert s2.decode_stats.pages_corrected > 0
    for i in range(eng.cfg.num_layers):
        assert torch.equal(torch.cat([eng.pool.k[i][e.blocks] for e in entries]), shared[i])
    n = s1.gen_count
    quest_k = [eng.pool.k[i][s1.gen_blocks].flatten(0, 1)[:n] for i in range(eng.cfg.num_layers)]
    retro_k = [eng.pool.k[i][s2.gen_blocks].flatten(0, 1)[:n] for i in range(eng.cfg.num_layers)]
    assert torch.equal(quest_k[0], retro_k[0]) and torch.equal(quest_k[1], retro_k[1])   # dense + first sparse
    assert not torch.allclose(quest_k[2], retro_k[2])                                       # re-embedded above
    for e in entries:
        eng.cache.release(e)
    eng.release(s1)
    eng.release(s2)


def test_dense_quest_and_retro_sequences_in_one_batch_get_what_each_gets_alone(tiny_dir):
    eng = Engine.load(tiny_dir)
    policies = [DENSE, eng.decode_policy("quest", budget_tokens=32, dense_layers=1),
                eng.decode_policy("retro", budget_tokens=32, dense_layers=1, retro_window=3),
                eng.decode_policy("retro", budget_tokens=48, dense_layers=0, retro_window=2)]
    requests = [random_request(60 + i, lengths=(33, 40 + i), suffix_len=3) for i in range(len(policies))]
    tokens = [9, 4, 7, 1, 8, 2]
    alone = []
    for request, policy in zip(requests, policies):
        seq, logits = _decode(eng, request, policy, tokens)
        alone.append(logits)
        eng.release(seq)
    seqs = []
    for request, policy in zip(requests, policies):
        _, h = eng.prefill_handoff(*request)
        seqs.append(eng.import_handoff(h, decode=policy))
    together = torch.stack([eng.decode_step(seqs, [t] * len(seqs)) for t in tokens], 1)
    for want, got in zip(alone, together):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert seqs[2].decode_stats.pages_corrected > 0
    for seq in seqs:
        eng.release(seq)


def test_bad_retro_parameters_are_refused_by_name(engine):
    chunks, suffix = random_request(8)
    for kwargs, match in ((dict(retro_window=0), "retro_window"), (dict(retro_window=17), "retro_window"),
                          (dict(retro_window=True), "retro_window"), (dict(retro_window=2.0), "retro_window"),
                          (dict(dense_layers=engine.cfg.num_layers), "dense_layers must leave a sparse layer"),
                          (dict(budget_tokens=8), "budget_tokens must be at least one page")):
        with pytest.raises(ValueError, match=match):
            engine.generate(chunks, suffix, max_new_tokens=2, decode="retro", **kwargs)
    assert policy_for("retro") == RetroDecode(2048, 2, 2) and engine.cache.resident_bytes == 0


@pytest.mark.parametrize("decode", ["quest", "retro"])
def test_a_decode_graphs_step_equals_the_eager_step(tiny_dir, decode):
    """The step a decode graph captures (on the CPU: the same body run eagerly on its fixed, padded buffers) gives
    the eager step's logits and stats, batch after batch, for Quest and Retro (past rows padded to the bucket)."""
    params = dict(budget_tokens=32, dense_layers=1) | (dict(retro_window=3) if decode == "retro" else {})
    eager, graphs = Engine.load(tiny_dir), Engine.load(tiny_dir, static_tails=True)
    requests = [random_request(70 + i, lengths=(31, 45 + i), suffix_len=3) for i in range(3)]
    tokens = [9, 4, 7, 1, 8, 2, 6]
    out, stats = [], []
    for eng in (eager, graphs):
        seqs = []
        for request in requests:
            _, h = eng.prefill_handoff(*request)
            seqs.append(eng.import_handoff(h, decode=decode, **params))
        out.append(torch.stack([eng.decode_step(seqs, [t] * len(seqs)) for t in tokens]))
        stats.append([s.decode_stats.as_dict() for s in seqs])
        for seq in seqs:
            eng.release(seq)
    assert graphs.forward.decode_graphs.replays == len(tokens)
    torch.testing.assert_close(out[1], out[0], rtol=1e-5, atol=1e-5)
    assert stats[1] == stats[0] and all(s["pages_read"] < s["pages_visible"] for s in stats[0])
    if decode == "retro":
        assert all(s["pages_corrected"] > 0 for s in stats[0])


def test_windows_live_in_device_records_that_grow_and_are_given_back(tiny_dir):
    """The windows' records (RetroRecords): a step's tokens and corrected past tokens go to records taken anew and the
    old ones come back, so the records held are the windows' tokens; records too few for a step grow (every tensor
    moved, a graph captured before capturing again) and the sequences decode as with records to spare; a released
    sequence gives its records back."""
    from services.engine.decode import RetroRecords

    params = dict(budget_tokens=32, dense_layers=1, retro_window=6)
    requests = [random_request(80 + i, lengths=(30, 41 + i), suffix_len=3) for i in range(3)]
    tokens = [5, 9, 2, 7, 3, 8, 1, 4]
    out = []
    for capacity in (3, 4096):
        eng = Engine.load(tiny_dir)
        policy = eng.decode_policy("retro", **params)
        key = (eng.cfg.num_layers - policy.dense_layers, policy.budget_tokens // eng.block_size)
        assert eng.describe_memory()["retro_records_bytes"] == 0
        rec = eng.forward.retro_records[key] = RetroRecords(eng.forward, *key, capacity=capacity)
        step = policy.graph_step(eng.forward, 4, None)
        seqs = []
        for request in requests:
            _, h = eng.prefill_handoff(*request)
            seqs.append(eng.import_handoff(h, decode=policy))
        logits = []
        for t in tokens:
            logits.append(eng.decode_step(seqs, [t] * len(seqs)))
            assert rec.held == sum(len(s.past) for s in seqs) and all(len(s.past) <= 5 for s in seqs)
        out.append(torch.stack(logits))
        assert step.stale() == (capacity == 3) and rec.capacity >= 2 + 3 * (5 + 6)
        s_layers, hq, hkv, d, k, hidden = rec.dims     # h, q, out, lse, sel, entries a record, in the pool's dtype
        size = eng.pool.k[0].element_size()
        per = hidden * size + 2 * s_layers * hq * d * size + s_layers * hq * 4 + s_layers * hkv * k * 8 + s_layers * 8
        assert eng.describe_memory()["retro_records_bytes"] == rec.nbytes == rec.capacity * per
        step.captured()
        assert not step.stale()
        assert len({t.record for s in seqs for t in s.past}) == rec.held        # no record is two tokens'
        assert RetroRecords.EMPTY not in {t.record for s in seqs for t in s.past}
        assert torch.equal(rec.lse[:, RetroRecords.EMPTY], torch.full_like(rec.lse[:, 0], float("-inf")))
        eng.release(seqs[0])
        assert rec.held == sum(len(s.past) for s in seqs[1:]) and not seqs[0].past
        for seq in seqs[1:]:
            eng.release(seq)
        assert rec.held == 0
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=0)


def test_records_a_failed_step_took_come_back(tiny_dir, monkeypatch):
    """A Retro step failing between taking its records and handing them over (its correction kernel raising) leaves
    them pending for its sequences: they come back at the sequence's next step, or when it is released."""
    from kernels import sparse as sparse_mod

    eng = Engine.load(tiny_dir)
    policy = eng.decode_policy("retro", budget_tokens=32, dense_layers=1, retro_window=3)
    seqs = [eng.import_handoff(eng.prefill_handoff(*random_request(120 + i, **LONG))[1], decode=policy)
            for i in range(2)]
    for t in (3, 5, 7):
        eng.decode_step(seqs, [t, t])
    rec = next(iter(eng.forward.retro_records.values()))
    windows = sum(len(s.past) for s in seqs)
    assert rec.held == windows == 4
    real = sparse_mod.quest_retro_attention
    monkeypatch.setattr(sparse_mod, "quest_retro_attention", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        eng.decode_step(seqs, [2, 2])
    assert rec.held == windows + 2 + windows and len(rec.pending) == 2      # taken: a token's and a corrected each
    monkeypatch.setattr(sparse_mod, "quest_retro_attention", real)
    eng.decode_step(seqs, [4, 4])                                            # the next step gives them back first
    assert rec.held == sum(len(s.past) for s in seqs) and not rec.pending
    monkeypatch.setattr(sparse_mod, "quest_retro_attention", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        eng.decode_step(seqs, [6, 6])
    for s in seqs:
        eng.release(s)
    assert rec.held == 0 and not rec.pending
