"""The ratio-0 reuse pass as one copy and one replay (reuse_tail.py) equals the general static path bit for
bit, and leaves a Sequence that decodes and hands off like any other."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.engine import Engine
from services.engine.graphs.tails import PAD_POS

from ..conftest import cpu_triton, random_request


def _general(monkeypatch, eng, fn):
    """fn() with the engine's reuse_graph option off: the general path, on the same engine (its cache and pool as
    they are)."""
    with monkeypatch.context() as m:
        m.setattr(eng.forward, "options", dataclasses.replace(eng.options, reuse_graph=False))
        return fn()


@pytest.mark.parametrize("mode, block_size", [("tessera", 16), ("tessera", 7), ("position_aware", 16)])
@pytest.mark.slow
def test_ratio_zero_lean_pass_equals_the_general_one(tiny_dir, monkeypatch, mode, block_size):
    eng = Engine.load(tiny_dir, static_tails=True, block_size=block_size)
    # a long request, a shorter one (same buckets: stale rows and entries must be padding again), a longer
    for seed, lengths, suffix_len in ((100, (20, 33, 17), 9), (101, (20, 9), 2), (102, (17, 33, 20, 5), 12)):
        chunks, suffix = random_request(seed, lengths=lengths, suffix_len=suffix_len)
        want = _general(monkeypatch, eng, lambda: eng.prefill(chunks, suffix, mode=mode, recompute_ratio=0.0))
        before = eng.forward.id_tails.replays if eng.forward.id_tails else 0
        got = eng.prefill(chunks, suffix, mode=mode, recompute_ratio=0.0)
        assert eng.forward.id_tails.replays == before + 1
        assert torch.equal(got.logits, want.logits)
        assert got.stats.private_blocks_allocated == want.stats.private_blocks_allocated
    # the general path's static tails were used by the reference passes only
    assert len(eng.forward.id_tails.tails) == 1  # one (token, entry) bucket served all three


def test_the_lean_pass_leaves_a_sequence_that_decodes_and_hands_off(tiny_dir, monkeypatch):
    eng = Engine.load(tiny_dir, static_tails=True)
    chunks, suffix = random_request(103, lengths=(20, 33, 17), suffix_len=6)
    want = _general(monkeypatch, eng, lambda: eng.generate(chunks, suffix, max_new_tokens=8, recompute_ratio=0.0,
                                                      stop_token_ids=[]))
    assert eng.generate(chunks, suffix, max_new_tokens=8, recompute_ratio=0.0, stop_token_ids=[]) == want
    # the sequence's table is a view of the request's own device buffer, not of the tail's inputs: a
    # later request refilling the tail leaves it as it was
    logits, seq, _ = eng._prefill(chunks, suffix, "tessera", 0.0)
    table = seq.layer_tables[0]
    rows = (table.block_ids.clone(), table.offsets.clone(), table.masks.clone(), table.id_rows.clone())
    other, other_suffix = random_request(104, lengths=(9, 30), suffix_len=3)
    eng.prefill(other, other_suffix, recompute_ratio=0.0)
    assert all(torch.equal(a, b) for a, b in zip(rows, (table.block_ids, table.offsets, table.masks, table.id_rows)))
    assert table.visible == sum(map(len, chunks)) + len(suffix) == seq.next_pos
    assert torch.equal(table.id_rows.to(torch.int32), torch.stack([table.block_ids, table.offsets]))
    # the suffix's slots hold their global positions; the scratch block's padded rows were left at 0
    pool, n = eng.pool, sum(map(len, chunks))
    n_sb = -(-len(suffix) // pool.block_size)
    s_entries = table.block_ids[-n_sb:].long()
    assert pool.slot_pos[s_entries].view(-1)[:len(suffix)].tolist() == list(range(n, n + len(suffix)))
    assert int(pool.slot_pos[eng.forward.scratch_block].max()) < PAD_POS
    eng.release(seq)
    res, handoff = eng.prefill_handoff(chunks, suffix, mode="tessera", recompute_ratio=0.0)
    assert torch.equal(res.logits, logits) and handoff is not None


@pytest.mark.slow
def test_triton_lean_pass_equals_the_general_one(tiny_dirs, monkeypatch):
    cpu_triton()
    eng = Engine.load(tiny_dirs["llama"], attention_backend="triton", static_tails=True)
    for seed, lengths, suffix_len in ((105, (13, 21, 9), 6), (106, (11, 9), 3)):
        chunks, suffix = random_request(seed, lengths=lengths, suffix_len=suffix_len)
        want = _general(monkeypatch, eng, lambda: eng.prefill(chunks, suffix, recompute_ratio=0.0))
        assert torch.equal(eng.prefill(chunks, suffix, recompute_ratio=0.0).logits, want.logits)
    assert all(type(t.attention).__name__ == "TritonStatic" for t in eng.forward.id_tails.tails.values())


def test_passes_the_lean_path_does_not_take(tiny_dir):
    """blend_copy (copies even at ratio 0), ratios above 0, and engines without static tails go the
    general way."""
    eng = Engine.load(tiny_dir, static_tails=True)
    chunks, suffix = random_request(107)
    eng.prefill(chunks, suffix, mode="blend_copy", recompute_ratio=0.0)
    eng.prefill(chunks, suffix, mode="tessera", recompute_ratio=0.3)
    assert eng.forward.id_tails is None
    eager = Engine.load(tiny_dir, static_tails=False)
    eager.prefill(chunks, suffix, recompute_ratio=0.0)
    assert eager.forward.id_tails is None
