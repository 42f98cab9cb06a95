"""The engine's full prefill and decode against transformers with the same weights (fp32)."""

from __future__ import annotations

import pytest
import torch

from services.engine import Engine

from .conftest import random_request

transformers = pytest.importorskip("transformers")


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@pytest.mark.parametrize("arch", ["llama", "llama3", "mistral", "qwen2", "qwen3"])
def test_full_prefill_logits_match_transformers(tiny_dirs, arch):
    eng = Engine.load(tiny_dirs[arch])
    hf = _hf(tiny_dirs[arch])
    chunks, suffix = random_request(1, lengths=(21, 40), suffix_len=9)
    with torch.no_grad():
        ref = hf(torch.tensor([sum(chunks, []) + suffix])).logits[0, -1]
    ours = eng.prefill(chunks, suffix, mode="full").logits
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_llama3_scaling_changes_the_rotation(tiny_dirs):
    """Guard against the scaled model silently running unscaled RoPE: the frequencies must differ."""
    plain = Engine.load(tiny_dirs["llama"]).forward.model.inv_freq
    scaled = Engine.load(tiny_dirs["llama3"]).forward.model.inv_freq
    assert not torch.allclose(plain, scaled)


@pytest.mark.parametrize("mode", ["full", "prefix"])
def test_greedy_decode_matches_transformers(tiny_dir, mode):
    eng = Engine.load(tiny_dir)
    hf = _hf(tiny_dir)
    chunks, suffix = random_request(2)
    ours = eng.generate(chunks, suffix, max_new_tokens=12, mode=mode, stop_token_ids=[])
    ids = torch.tensor([sum(chunks, []) + suffix])
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert ours == ref
