"""Quest decode (services/engine/decode/quest.py): page bounds that hold wherever a chunk is placed, a budget that
covers every page equals dense decoding, a small one attends only its pages, and bad parameters are refused."""

from __future__ import annotations

import pytest
import torch

from kernels.rope import rope_cos_sin, rope_inv_freq
from kernels.rope.reference import rotate
from services.engine import Engine
from services.engine.decode import DENSE, QuestDecode, policy_for
from services.engine.decode.quest import page_bounds, page_scores, quest_attention, select_pages

from ..conftest import random_request


@pytest.mark.parametrize("offset", [0, 37, 4096, 70000, 131000])
def test_page_score_bounds_the_best_key_wherever_the_page_is_placed(offset):
    """For pages of keys held at local positions and placed at ``offset``, the score is at least the true max of
    q·k over the page's visible keys at their global positions (over the KV head's query heads); for a page showing
    one key (kmin = kmax) it is that key's q·k exactly: the rotation by the offset is the one attention applies."""
    g = torch.Generator().manual_seed(offset)
    e, bs, hkv, group, d = 6, 16, 2, 3, 64
    inv = rope_inv_freq(d, 500000.0)
    k_local = torch.randn(e, bs, hkv, d, generator=g)
    visible = torch.rand(e, bs, generator=g) > 0.2
    visible[0] = False
    visible[0, 5] = True                                                    # page 0 shows one key
    q = torch.randn(hkv * group, d, generator=g)
    offs = torch.full((e,), offset, dtype=torch.int64)
    kmin, kmax = page_bounds(k_local, visible)
    scores = page_scores(q, kmin, kmax, offs, inv)                          # [E, Hkv]
    cos, sin = rope_cos_sin(offs, inv)
    k_global = rotate(k_local, cos[:, None, None, :], sin[:, None, None, :])   # the keys at positions offset + j
    # q is the query as the model holds it (rotated at its own position): its true scores are q·k at global positions
    true = torch.einsum("hgd,ebhd->ebhg", q.view(hkv, group, d), k_global)
    true = true.masked_fill(~visible[:, :, None, None], float("-inf")).amax(1).amax(-1)   # [E, Hkv]
    assert (scores >= true - 1e-4 * true.abs().clamp(min=1)).all()
    assert torch.isfinite(scores).all()
    torch.testing.assert_close(scores[0], true[0], rtol=1e-4, atol=1e-3)


def test_a_page_with_no_visible_key_scores_minus_infinity_and_the_newest_is_always_taken():
    k = torch.randn(4, 8, 1, 32)
    visible = torch.ones(4, 8, dtype=torch.bool)
    visible[1] = False
    kmin, kmax = page_bounds(k, visible)
    scores = page_scores(torch.randn(2, 32), kmin, kmax, torch.zeros(4, dtype=torch.int64), rope_inv_freq(32, 1e4))
    assert torch.isneginf(scores[1]).all()
    chosen = select_pages(torch.tensor([[5.0], [9.0], [1.0], [-3.0]]), 2)
    assert chosen[:, 0].tolist() == [False, True, False, True]              # the best other page, and the newest
    assert select_pages(torch.randn(3, 2), 10).all()                        # a budget past the pages: every page


def test_quest_attention_with_every_page_equals_dense_and_with_one_reads_only_the_newest():
    from kernels.paged_attention import paged_decode_attention

    g = torch.Generator().manual_seed(3)
    n_blocks, bs, hkv, d, hq = 12, 16, 2, 64, 4
    k_cache, v_cache = torch.randn(n_blocks, bs, hkv, d, generator=g), torch.randn(n_blocks, bs, hkv, d, generator=g)
    ids = torch.tensor([3, 7, 1, 9, 4, 0, 11], dtype=torch.int32)
    offs = torch.tensor([100, 100, 70000, 70000, 70000, 0, 0], dtype=torch.int32)
    masks = torch.tensor([-1, 0xFF, -1, -1, 0x0F0F, -1, 0x7], dtype=torch.int64)
    cu = torch.tensor([0, 4, 7], dtype=torch.int32)
    q = torch.randn(2, hq, d, generator=g)
    inv = rope_inv_freq(d, 500000.0)
    want, _ = paged_decode_attention(q, k_cache, v_cache, ids, offs, masks, cu, inv, d ** -0.5, backend="torch")
    got, chosen = quest_attention(q, k_cache, v_cache, ids, offs, masks, cu, inv, d ** -0.5, budget_pages=8)
    assert all(c.all() for c in chosen)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    one, chosen = quest_attention(q, k_cache, v_cache, ids, offs, masks, cu, inv, d ** -0.5, budget_pages=1)
    assert [c[:, 0].tolist() for c in chosen] == [[False, False, False, True], [False, False, True]]
    last, _ = paged_decode_attention(q[:1], k_cache, v_cache, ids[3:4], offs[3:4], masks[3:4],
                                     torch.tensor([0, 1], dtype=torch.int32), inv, d ** -0.5, backend="torch")
    torch.testing.assert_close(one[:1], last, rtol=1e-5, atol=1e-5)


def test_a_budget_covering_every_page_generates_what_dense_does(tiny_dir):
    eng = Engine.load(tiny_dir)
    chunks, suffix = random_request(31, lengths=(40, 27, 33), suffix_len=6)
    dense = eng.generate(chunks, suffix, max_new_tokens=8, stop_token_ids=[])
    quest = eng.generate(chunks, suffix, max_new_tokens=8, stop_token_ids=[], decode="quest", budget_tokens=4096,
                         dense_layers=0)
    assert quest == dense
    tight = eng.generate(chunks, suffix, max_new_tokens=8, stop_token_ids=[], decode="quest", budget_tokens=16,
                         dense_layers=0)
    assert len(tight) == 8


def test_dense_and_quest_sequences_in_one_step_get_what_each_gets_alone(tiny_dir):
    eng = Engine.load(tiny_dir)
    quest = eng.decode_policy("quest", budget_tokens=32, dense_layers=1)
    requests = [random_request(seed, lengths=(30, 21), suffix_len=4) for seed in (41, 42, 43)]
    policies = [DENSE, quest, quest]
    alone = []
    for (chunks, suffix), policy in zip(requests, policies):
        _, h = eng.prefill_handoff(chunks, suffix)
        seq = eng.import_handoff(h)
        seq.decode = policy
        alone.append(eng.decode_step([seq], [5])[0])
        eng.release(seq)
    seqs = []
    for (chunks, suffix), policy in zip(requests, policies):
        _, h = eng.prefill_handoff(chunks, suffix)
        seqs.append(eng.import_handoff(h))
        seqs[-1].decode = policy
    together = eng.decode_step(seqs, [5, 5, 5])
    for want, got in zip(alone, together):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for seq in seqs:
        eng.release(seq)


def test_bad_quest_parameters_are_refused_by_name(engine):
    chunks, suffix = random_request(7)
    for kwargs, match in ((dict(budget_tokens=8), "budget_tokens must be at least one page"),
                          (dict(budget_tokens=0), "budget_tokens"),
                          (dict(dense_layers=-1), "dense_layers"),
                          (dict(dense_layers=99), "dense_layers must be at most")):
        with pytest.raises(ValueError, match=match):
            engine.generate(chunks, suffix, max_new_tokens=2, decode="quest", **kwargs)
    with pytest.raises(TypeError, match="takes no parameters"):
        policy_for("dense", budget_tokens=64)
    assert policy_for("quest") == QuestDecode(2048, 2) and engine.cache.resident_bytes == 0
