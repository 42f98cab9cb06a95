"""Checkpoint loading: sharded safetensors, 16-bit dtypes, transformers v5 config spelling, init-tiny CLI."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.cli import main as tessera
from services.engine import Engine
from services.engine.model.tiny import write_tiny

from ..conftest import random_request


@pytest.mark.slow
def test_sharded_index_loads_the_same_model(tmp_path, tiny_dir):
    d = write_tiny(tmp_path / "sharded", seed=7)
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(d / fname))
        weight_map.update({k: fname for k in keys})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    chunks, suffix = random_request(60)
    a = Engine.load(tiny_dir).prefill(chunks, suffix, mode="full").logits
    b = Engine.load(d).prefill(chunks, suffix, mode="full").logits
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.slow
def test_16_bit_engines_track_fp32(tiny_dir, dtype):
    chunks, suffix = random_request(61)
    ref = torch.softmax(Engine.load(tiny_dir).prefill(chunks, suffix, mode="tessera").logits, -1)
    eng = Engine.load(tiny_dir, dtype=dtype)
    assert eng.pool.k[0].dtype == dtype
    out = torch.softmax(eng.prefill(chunks, suffix, mode="tessera").logits, -1)
    assert float((out - ref).abs().max()) < 0.05


def test_transformers_v5_config_spelling(tmp_path):
    d = write_tiny(tmp_path / "v5", arch="llama3", seed=3)
    cfg = json.loads((d / "config.json").read_text())
    legacy = Engine.load(d).forward.model.inv_freq
    cfg["rope_parameters"] = {**cfg.pop("rope_scaling"), "rope_theta": cfg.pop("rope_theta")}
    (d / "config.json").write_text(json.dumps(cfg))
    torch.testing.assert_close(Engine.load(d).forward.model.inv_freq, legacy)


def test_init_tiny_and_info_commands(tmp_path, capsys):
    assert tessera(["model", "init-tiny", str(tmp_path / "m"), "--arch", "qwen3", "--seed", "5"]) == 0
    assert tessera(["model", "info", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    assert "Qwen3ForCausalLM" in out and "KV per token" in out
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "m" / "tokenizer.json"))
    assert tok.decode(tok.encode("chunk KV, reused").ids) == "chunk KV, reused"
    assert tessera(["model", "init-tiny", str(tmp_path / "x"), "--arch", "gpt2"]) == 2
    assert "unknown tiny arch 'gpt2'" in capsys.readouterr().err
