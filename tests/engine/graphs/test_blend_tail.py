"""The ratio > 0 reuse pass as one copy and one graph (blend_tail.py) equals the general path: the same
tokens selected, the same tables, logits within fp32 rounding (its head runs padded rows), and a Sequence
that decodes and hands off like any other."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.engine import Engine
from services.engine.graphs import blend_tail

from ..conftest import cpu_triton, random_request

TOL = dict(rtol=1e-5, atol=1e-5)


def _general(monkeypatch, eng, fn):
    """fn() with the engine's blend_graph option off: the general path, on the same engine (its cache and pool as
    they are)."""
    with monkeypatch.context() as m:
        m.setattr(eng.forward, "options", dataclasses.replace(eng.options, blend_graph=False))
        return fn()


def _pass(eng, chunks, suffix, mode, ratio):
    """(logits, Sequence, stats) of a pass that keeps its tables; the sequence is released by the caller."""
    return eng._prefill(chunks, suffix, mode, ratio, ids=[eng.chunk_id(c) for c in chunks])


def _same_tables(a, b):
    """Tables of sequence a equal b's, b's private blocks read as a's (both passes allocate them in one order)."""
    assert len(a.layer_tables) == len(b.layer_tables) and len(a.private_blocks) == len(b.private_blocks)
    as_a = dict(zip(b.private_blocks, a.private_blocks))
    for ta, tb in zip(a.layer_tables, b.layer_tables):
        assert (ta.visible, ta.max_offset) == (tb.visible, tb.max_offset)
        assert ta.block_ids.tolist() == [as_a.get(i, i) for i in tb.block_ids.tolist()]
        assert torch.equal(ta.offsets, tb.offsets) and torch.equal(ta.masks, tb.masks)


@pytest.mark.parametrize("mode, ratio, block_size", [("tessera", 0.15, 16), ("tessera", 0.3, 7), ("tessera", 1.0, 16),
                                                     ("position_aware", 0.3, 16), ("tessera", 0.3, 64)])
def test_blend_tail_equals_the_general_pass(tiny_dir, monkeypatch, mode, ratio, block_size):
    eng = Engine.load(tiny_dir, static_tails=True, block_size=block_size)
    # a long request, a shorter one (same buckets: stale rows and entries must be padding again), a longer one
    for seed, lengths, suffix_len in ((110, (20, 33, 17), 9), (111, (20, 9), 2), (112, (17, 33, 20, 5), 12)):
        chunks, suffix = random_request(seed, lengths=lengths, suffix_len=suffix_len)
        want_logits, want_seq, want = _general(monkeypatch, eng, lambda: _pass(eng, chunks, suffix, mode, ratio))
        before = eng.forward.blend_tails.replays if eng.forward.blend_tails else 0
        logits, seq, stats = _pass(eng, chunks, suffix, mode, ratio)
        assert eng.forward.blend_tails.replays == before + 1
        torch.testing.assert_close(logits, want_logits, **TOL)
        assert stats.tokens_recomputed == want.tokens_recomputed == round(ratio * sum(lengths))
        assert stats.private_blocks_allocated == want.private_blocks_allocated
        _same_tables(seq, want_seq)  # the same tokens selected: the same twins hidden
        # the recomputed tokens' and the suffix's private slots hold the same positions in both passes (the
        # slots they show; the others may hold an earlier request's)
        for a, b in zip(seq.private_blocks, want_seq.private_blocks):
            shown = [j for j in range(block_size) if int(seq.layer_tables[-1].masks[
                seq.layer_tables[-1].block_ids.tolist().index(a)]) >> j & 1]
            assert shown and eng.pool.slot_pos[a, shown].tolist() == eng.pool.slot_pos[b, shown].tolist()
        eng.release(want_seq)
        eng.release(seq)
    assert len(eng.forward.blend_tails.tails) < eng.forward.blend_tails.replays  # buckets were reused


def test_blend_tail_leaves_a_sequence_that_decodes_and_hands_off(tiny_dir, monkeypatch):
    eng = Engine.load(tiny_dir, static_tails=True)
    chunks, suffix = random_request(113, lengths=(20, 33, 17), suffix_len=6)
    want = _general(monkeypatch, eng, lambda: eng.generate(chunks, suffix, max_new_tokens=8, recompute_ratio=0.3,
                                                      stop_token_ids=[]))
    assert eng.generate(chunks, suffix, max_new_tokens=8, recompute_ratio=0.3, stop_token_ids=[]) == want
    # the sequence's tables are the request's own device copies: a later request refilling the graph's
    # inputs leaves them as they were
    _, seq, _ = _pass(eng, chunks, suffix, "tessera", 0.3)
    rows = [(t.block_ids.clone(), t.masks.clone()) for t in seq.layer_tables[:2]]
    other, other_suffix = random_request(114, lengths=(9, 30), suffix_len=3)
    eng.prefill(other, other_suffix, recompute_ratio=0.3)
    assert all(torch.equal(a, t.block_ids) and torch.equal(m, t.masks) for (a, m), t in zip(rows, seq.layer_tables))
    eng.release(seq)
    res, handoff = eng.prefill_handoff(chunks, suffix, mode="tessera", recompute_ratio=0.3)
    want_res, _ = _general(monkeypatch, eng, lambda: eng.prefill_handoff(chunks, suffix, mode="tessera",
                                                                     recompute_ratio=0.3))
    torch.testing.assert_close(res.logits, want_res.logits, **TOL)
    assert handoff is not None and res.stats.tokens_recomputed == want_res.stats.tokens_recomputed


@pytest.mark.slow
def test_triton_blend_tail_equals_the_general_pass(tiny_dirs, monkeypatch):
    cpu_triton()
    eng = Engine.load(tiny_dirs["llama"], attention_backend="triton", static_tails=True)
    for seed, lengths, suffix_len in ((115, (13, 21, 9), 6), (116, (11, 9), 3)):
        chunks, suffix = random_request(seed, lengths=lengths, suffix_len=suffix_len)
        want = _general(monkeypatch, eng, lambda: eng.prefill(chunks, suffix, recompute_ratio=0.3))
        got = eng.prefill(chunks, suffix, recompute_ratio=0.3)
        torch.testing.assert_close(got.logits, want.logits, rtol=2e-4, atol=2e-4)
        assert got.stats.tokens_recomputed == want.stats.tokens_recomputed
    assert all(type(t.attention).__name__ == "PositionalAttention" for t in eng.forward.blend_tails.tails.values())


@pytest.mark.slow
def test_passes_the_blend_tail_does_not_take(tiny_dir, monkeypatch):
    """blend_copy, a later check layer, requests past HEAD_MAX_TOKENS, ratio 0 and engines without static
    tails go other ways, with the same result as before."""
    chunks, suffix = random_request(117)
    eng = Engine.load(tiny_dir, static_tails=True)
    eng.prefill(chunks, suffix, mode="blend_copy", recompute_ratio=0.3)
    eng.prefill(chunks, suffix, mode="tessera", recompute_ratio=0.0)
    monkeypatch.setattr(blend_tail, "HEAD_MAX_TOKENS", sum(map(len, chunks)) + len(suffix) - 1)
    eng.prefill(chunks, suffix, mode="tessera", recompute_ratio=0.3)
    assert eng.forward.blend_tails is None
    monkeypatch.undo()
    later = Engine.load(tiny_dir, static_tails=True, check_layer=2)
    later.prefill(chunks, suffix, mode="tessera", recompute_ratio=0.3)
    assert later.forward.blend_tails is None
    eager = Engine.load(tiny_dir, static_tails=False)
    eager.prefill(chunks, suffix, recompute_ratio=0.3)
    assert eager.forward.blend_tails is None


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cuda_blend_tail_equals_the_general_pass(tiny_dir, monkeypatch, backend):
    """The graph (captured, then replayed by a second and a shorter request) against the general path on a GPU, in
    bf16: the same tokens selected and tables, logits within bf16 rounding, and no host sync in the pass."""
    eng = Engine.load(tiny_dir, device="cuda", dtype=torch.bfloat16, attention_backend=backend, static_tails=True)
    for seed, lengths, suffix_len in ((118, (40, 33, 57), 9), (119, (40, 33, 57), 9), (120, (20, 9), 3)):
        chunks, suffix = random_request(seed, lengths=lengths, suffix_len=suffix_len)
        want_logits, want_seq, want = _general(monkeypatch, eng, lambda: _pass(eng, chunks, suffix, "tessera", 0.3))
        eng.prefill(chunks, suffix, recompute_ratio=0.3)  # captured on first use
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            logits, seq, stats = _pass(eng, chunks, suffix, "tessera", 0.3)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.testing.assert_close(logits, want_logits, rtol=0.05, atol=0.05)
        assert stats.tokens_recomputed == want.tokens_recomputed
        _same_tables(seq, want_seq)
        eng.release(want_seq)
        eng.release(seq)
    assert eng.forward.blend_tails.replays >= 6 and len(eng.forward.blend_tails.tails) == 2


@pytest.mark.parametrize("arch", ["llama3", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("deviation", ["kv", "k"])
def test_blend_tail_on_every_architecture(tiny_dirs, monkeypatch, arch, deviation):
    """Llama-3.1 rope scaling, Mistral, Qwen2's q|k|v bias, Qwen3's q/k norms; the deviation by K alone too."""
    eng = Engine.load(tiny_dirs[arch], static_tails=True, deviation=deviation)
    chunks, suffix = random_request(121, lengths=(20, 33, 17), suffix_len=6)
    want_logits, want_seq, _ = _general(monkeypatch, eng, lambda: _pass(eng, chunks, suffix, "tessera", 0.3))
    logits, seq, _ = _pass(eng, chunks, suffix, "tessera", 0.3)
    assert eng.forward.blend_tails.replays == 1
    torch.testing.assert_close(logits, want_logits, **TOL)
    _same_tables(seq, want_seq)
    eng.release(want_seq)
    eng.release(seq)
