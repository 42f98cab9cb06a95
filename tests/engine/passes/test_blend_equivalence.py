"""Equivalences of the reuse modes that hold exactly in math (DESIGN.md, 'Testing without a GPU')."""

from __future__ import annotations

import pytest
import torch

from services.engine import Engine

from ..conftest import random_request

transformers = pytest.importorskip("transformers")
TOL = dict(rtol=1e-4, atol=1e-4)


def test_single_chunk_at_offset_zero_equals_full(engine):
    chunks, suffix = random_request(3, lengths=(45,))
    full = engine.prefill(chunks, suffix, mode="full").logits
    for ratio in (0.0, 0.15):
        torch.testing.assert_close(engine.prefill(chunks, suffix, mode="tessera", recompute_ratio=ratio).logits, full, **TOL)


@pytest.mark.parametrize("mode", ["tessera", "blend_copy", "position_aware"])
def test_ratio_one_equals_full_prefill(engine, mode):
    chunks, suffix = random_request(4, lengths=(20, 33, 17, 5))
    full = engine.prefill(chunks, suffix, mode="full").logits
    torch.testing.assert_close(engine.prefill(chunks, suffix, mode=mode, recompute_ratio=1.0).logits, full, **TOL)


def test_ratio_one_equals_full_with_a_later_check_layer(tiny_dir):
    eng = Engine.load(tiny_dir, check_layer=2)
    chunks, suffix = random_request(5)
    full = eng.prefill(chunks, suffix, mode="full").logits
    torch.testing.assert_close(eng.prefill(chunks, suffix, mode="tessera", recompute_ratio=1.0).logits, full, **TOL)


def test_prefix_mode_is_exact_on_hits(engine):
    chunks, suffix = random_request(6)
    full = engine.prefill(chunks, suffix, mode="full").logits
    first = engine.prefill(chunks, suffix, mode="prefix")
    again = engine.prefill(chunks, suffix[:3], mode="prefix")
    assert first.stats.chunk_misses == 3 and again.stats.chunk_hits == 3
    torch.testing.assert_close(first.logits, full, **TOL)
    torch.testing.assert_close(again.logits, engine.prefill(chunks, suffix[:3], mode="full").logits, **TOL)


def _block_attention_reference(hf, chunks, suffix):
    """Block-Attention by transformers alone: each chunk prefilled alone, its keys re-rotated to the
    chunk's global offset with transformers' own RoPE, caches concatenated, then the suffix."""
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import rotate_half

    n_layers = hf.config.num_hidden_layers
    keys = [[] for _ in range(n_layers)]
    vals = [[] for _ in range(n_layers)]
    start = 0
    with torch.no_grad():
        for c in chunks:
            out = hf(torch.tensor([c]), use_cache=True)
            ids = torch.full((1, len(c)), start)
            cos, sin = hf.model.rotary_emb(out.past_key_values.layers[0].keys, ids)  # [1, L, D]
            for layer in range(n_layers):
                k = out.past_key_values.layers[layer].keys  # [1, Hkv, L, D]
                keys[layer].append(k * cos[:, None] + rotate_half(k) * sin[:, None])
                vals[layer].append(out.past_key_values.layers[layer].values)
            start += len(c)
        cache = DynamicCache()
        for layer in range(n_layers):
            cache.update(torch.cat(keys[layer], dim=2), torch.cat(vals[layer], dim=2), layer)
        pos = torch.arange(start, start + len(suffix))[None]
        return hf(torch.tensor([suffix]), position_ids=pos, past_key_values=cache).logits[0, -1]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_ratio_zero_equals_block_attention_reference(tiny_dirs, arch):
    eng = Engine.load(tiny_dirs[arch])
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    chunks, suffix = random_request(7, lengths=(19, 40, 26))
    ref = _block_attention_reference(hf, chunks, suffix)
    for mode in ("tessera", "blend_copy", "position_aware"):
        ours = eng.prefill(chunks, suffix, mode=mode, recompute_ratio=0.0).logits
        torch.testing.assert_close(ours, ref, **TOL)
    # and it really differs from a full prefill: the chunks do not see each other
    assert (eng.prefill(chunks, suffix, mode="full").logits - ref).abs().max() > 1e-2


@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.15, 0.3, 0.5, 0.8, 1.0])
def test_tessera_agrees_with_blend_copy(engine, ratio):
    chunks, suffix = random_request(8, lengths=(30, 17, 41))
    a = engine.prefill(chunks, suffix, mode="tessera", recompute_ratio=ratio)
    b = engine.prefill(chunks, suffix, mode="blend_copy", recompute_ratio=ratio)
    assert a.stats.tokens_recomputed == b.stats.tokens_recomputed == round(ratio * 88)
    assert b.stats.copied_blocks > 0 and a.stats.copied_blocks == 0
    torch.testing.assert_close(a.logits, b.logits, **TOL)


def test_kl_to_full_falls_as_ratio_rises(engine):
    ratios = (0.0, 0.15, 0.5, 1.0)
    kl = {r: 0.0 for r in ratios}
    seeds = range(4)
    for seed in seeds:
        chunks, suffix = random_request(100 + seed, lengths=(40, 40, 40, 40), suffix_len=8)
        ref = torch.log_softmax(engine.prefill(chunks, suffix, mode="full").logits, -1)
        for r in ratios:
            lp = torch.log_softmax(engine.prefill(chunks, suffix, mode="tessera", recompute_ratio=r).logits, -1)
            kl[r] += float(torch.sum(ref.exp() * (ref - lp))) / len(seeds)
    assert kl[0.0] > kl[0.15] > kl[0.5] > kl[1.0]
    assert kl[0.0] > 0.05 and kl[1.0] < 1e-5


def test_recomputed_tokens_never_see_later_tokens(engine):
    """Causality over scattered recomputed tokens: appending a chunk after the suffix's context must not
    change the KV a recomputed token produced. Checked through ratio 1.0 == full on a prefix request:
    the logits after a shorter request equal those of full prefill on that shorter request."""
    chunks, suffix = random_request(9, lengths=(25, 25, 25))
    for cut in (1, 2):
        full = engine.prefill(chunks[:cut], suffix, mode="full").logits
        torch.testing.assert_close(engine.prefill(chunks[:cut], suffix, mode="tessera", recompute_ratio=1.0).logits,
                                   full, **TOL)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("mode", ["tessera", "blend_copy", "position_aware"])
def test_no_chunks_at_a_ratio_above_zero_is_the_suffix_alone(tiny_dir, mode, static):
    """A retrieval that found nothing: no chunk token to select or copy, so every ratio computes the suffix
    alone at every layer, as ratio 0 does: full prefill's logits; decode goes on from it."""
    eng = Engine.load(tiny_dir, static_tails=static)
    suffix = random_request(130, suffix_len=11)[1]
    want = eng.prefill([], suffix, mode="full").logits
    for ratio in (0.15, 1.0):
        got = eng.prefill([], suffix, mode=mode, recompute_ratio=ratio)
        assert got.stats.tokens_recomputed == 0
        torch.testing.assert_close(got.logits, want, rtol=1e-5, atol=1e-5)
    assert eng.generate([], suffix, max_new_tokens=4, mode=mode, recompute_ratio=0.15, stop_token_ids=[]) == \
        eng.generate([], suffix, max_new_tokens=4, mode="full", stop_token_ids=[])
    assert eng.pool.num_free + sum(len(e.blocks) for e in eng.cache._entries.values()) == eng.pool.usable_blocks
