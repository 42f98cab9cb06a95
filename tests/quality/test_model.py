"""The training model is a Hugging Face Llama: same names, same logits; the reuse mask means chunk-alone KV."""

from __future__ import annotations

import json

import pytest
import torch

from loadgen.quality.cli import COMMITTED_MODEL
from loadgen.quality.model import ModelConfig, TinyLlama, load_hf, save_hf
from loadgen.quality.reference import chunk_spans, reuse_mask
from loadgen.quality.tasks import TaskConfig

transformers = pytest.importorskip("transformers")


def _random_model(cfg: ModelConfig, seed: int = 0) -> TinyLlama:
    torch.manual_seed(seed)
    model = TinyLlama(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1, weights large enough to matter
            p.normal_(mean=1.0 if p.dim() == 1 else 0.0, std=0.2 if p.dim() == 1 else 0.08)
    return model


@pytest.mark.parametrize("cfg", [
    ModelConfig(),                                                   # the shipped shape: 4 heads, 2 KV heads
    ModelConfig(vocab_size=300, hidden=96, layers=2, heads=6, kv_heads=1, intermediate=200),
    ModelConfig(vocab_size=268, hidden=128, layers=3, heads=2, kv_heads=2, intermediate=256, rope_theta=500.0),
], ids=["4L-H4-KV2", "2L-H6-KV1", "3L-H2-KV2-theta500"])
def test_saved_directory_gives_transformers_the_same_logits(cfg, tmp_path):
    model = _random_model(cfg)
    save_hf(model, tmp_path, dtype="float32")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 77), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert ours.abs().max() > 1.0
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    names = set(hf.state_dict())
    assert {"model.layers.0.self_attn.k_proj.weight", "model.norm.weight", "lm_head.weight"} <= names
    assert load_hf(tmp_path).state_dict().keys() == model.state_dict().keys()


def test_committed_model_is_a_half_precision_hf_llama():
    cfg = json.loads((COMMITTED_MODEL / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["dtype"] in ("float16", "bfloat16")
    assert (COMMITTED_MODEL / "model.safetensors").stat().st_size < 8 << 20
    assert "--seed" in (COMMITTED_MODEL / "README.md").read_text()
    ours = load_hf(COMMITTED_MODEL)
    hf = transformers.LlamaForCausalLM.from_pretrained(COMMITTED_MODEL, dtype=torch.float32).eval()
    tokens = torch.randint(0, cfg["vocab_size"], (1, 145), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=1e-4, atol=1e-4)


def test_reuse_mask_equals_each_chunk_computed_alone():
    """Chunk tokens under the mask see what they would see alone at local positions (RoPE is relative)."""
    task = TaskConfig(max_chunks=3)
    model = _random_model(ModelConfig(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128))
    tokens = torch.randint(3, 268, (1, 1 + 3 * task.chunk_len + 4), generator=torch.Generator().manual_seed(3))
    spans = chunk_spans(task, 3)
    with torch.no_grad():
        masked = model(tokens, reuse_mask(tokens.shape[1], spans))
        for start, end in spans:
            torch.testing.assert_close(masked[0, start:end], model(tokens[:, start:end])[0], rtol=1e-4, atol=1e-4)
        # The suffix sees everything, so it differs from a causal pass only through the chunks' KV.
        assert not torch.allclose(masked[0, -1], model(tokens)[0, -1], atol=1e-3)
