"""The ``tiny`` preset: a small random Llama-family model written as a Hugging Face directory.

``write_tiny(dir, arch="llama", seed=0)`` writes config.json, model.safetensors and a byte-level
tokenizer.json that ``Engine.load`` and ``transformers`` both read. Query/key projections are drawn
larger than the usual 0.02 so that attention is peaked and cross-chunk effects are measurable.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from services.engine.model.config import ModelConfig

TINY_ARCHS = {
    "llama": "LlamaForCausalLM",
    "llama3": "LlamaForCausalLM",     # Llama-3.1 style rope scaling
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>"]
BYTE_VOCAB = 256


def tiny_config(arch: str = "llama", **overrides) -> ModelConfig:
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; one of {', '.join(TINY_ARCHS)}")
    fields = dict(
        architecture=TINY_ARCHS[arch], vocab_size=320, hidden_size=128, intermediate_size=256,
        num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=131072, bos_token_id=BYTE_VOCAB, eos_token_id=BYTE_VOCAB + 1,
    )
    if arch == "llama3":
        fields.update(rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192})
    if arch == "qwen2":
        fields.update(attention_bias=True)
    if arch == "qwen3":
        fields.update(qk_norm=True)
    fields.update(overrides)
    return ModelConfig(**fields)


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def normal(*shape, std):
        return torch.randn(*shape, generator=g) * std

    def norm_w(n):
        return 1.0 + normal(n, std=0.1)

    hd, hq, hkv, hid, inter = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size, cfg.intermediate_size
    w = {"model.embed_tokens.weight": normal(cfg.vocab_size, hid, std=1.0), "model.norm.weight": norm_w(hid)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_w(hid)
        w[p + "post_attention_layernorm.weight"] = norm_w(hid)
        w[p + "self_attn.q_proj.weight"] = normal(hq * hd, hid, std=2.0 / hid ** 0.5)
        w[p + "self_attn.k_proj.weight"] = normal(hkv * hd, hid, std=2.0 / hid ** 0.5)
        w[p + "self_attn.v_proj.weight"] = normal(hkv * hd, hid, std=1.0 / hid ** 0.5)
        w[p + "self_attn.o_proj.weight"] = normal(hid, hq * hd, std=1.0 / (hq * hd) ** 0.5)
        w[p + "mlp.gate_proj.weight"] = normal(inter, hid, std=1.0 / hid ** 0.5)
        w[p + "mlp.up_proj.weight"] = normal(inter, hid, std=1.0 / hid ** 0.5)
        w[p + "mlp.down_proj.weight"] = normal(hid, inter, std=1.0 / inter ** 0.5)
        if cfg.attention_bias:
            for n, out in (("q", hq * hd), ("k", hkv * hd), ("v", hkv * hd)):
                w[p + f"self_attn.{n}_proj.bias"] = normal(out, std=0.1)
        if cfg.qk_norm:
            w[p + "self_attn.q_norm.weight"] = norm_w(hd)
            w[p + "self_attn.k_norm.weight"] = norm_w(hd)
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = normal(cfg.vocab_size, hid, std=1.0 / hid ** 0.5)
    return w


def byte_tokenizer_json() -> str:
    """A byte-level tokenizer (256 byte symbols + specials, no merges) as tokenizer.json text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for j, s in enumerate(SPECIALS):
        vocab[s] = BYTE_VOCAB + j
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok.to_str()


def write_tiny(path: str | Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(arch, **overrides)
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    save_file(random_weights(cfg, seed), str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "tokenizer.json").write_text(byte_tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0], "eos_token": SPECIALS[1],
        "pad_token": SPECIALS[2]}, indent=2))
    return path
