"""Bad input is refused with a ValueError naming the cause, before anything is computed or cached."""

from __future__ import annotations

import json

import pytest
import torch

from services.engine import Engine
from services.engine.model.tiny import write_tiny

from .conftest import random_request


def _snapshot(eng):
    return (sorted(eng.cache.keys()), eng.pool.num_free, eng.cache.resident_bytes)


@pytest.mark.parametrize("kwargs, match", [
    (dict(chunks=[], suffix=[]), "empty request"),
    (dict(chunks=[[1, 2]], suffix=[]), "suffix must hold"),
    (dict(chunks=[[1, 2], []], suffix=[3]), "chunk 1 is empty"),
    (dict(chunks=[[1, 320]], suffix=[3]), "token id 320 in chunk 0"),
    (dict(chunks=[[1]], suffix=[-1]), "token id -1 in suffix"),
    (dict(chunks=[[1, 2.5]], suffix=[3]), "token id 2.5 in chunk 0 is not an integer"),  # never truncated
    (dict(chunks=[[1]], suffix=["7"]), "token id '7' in suffix is not an integer"),
    (dict(chunks=[[1]], suffix=torch.tensor([2.0])), "in suffix is not an integer"),
    (dict(chunks=[[1]], suffix=[2], mode="lazy"), "unknown mode"),
    (dict(chunks=[[1]], suffix=[2], recompute_ratio=1.5), "recompute_ratio"),
])
def test_bad_requests_are_refused(engine, kwargs, match):
    chunks, suffix = random_request(20)
    engine.prefill(chunks, suffix)
    before = _snapshot(engine)
    with pytest.raises(ValueError, match=match):
        engine.prefill(**kwargs)
    assert _snapshot(engine) == before
    torch.testing.assert_close(engine.prefill(chunks, suffix).logits, engine.prefill(chunks, suffix).logits)


def test_chunk_id_refuses_ids_it_would_truncate(engine):
    """A chunk's id reads its tokens as a request does: the same id for a list, a tuple, an array and a tensor of
    the same ids; a float, a string or an id past int64 refused by name (never truncated into another chunk)."""
    import numpy as np

    want = engine.chunk_id([5, 17, 3])
    for same in ((5, 17, 3), np.array([5, 17, 3]), torch.tensor([5, 17, 3]), iter([5, 17, 3])):
        assert engine.chunk_id(same) == want
    assert engine.chunk_id([5, 17, 4]) != want
    for bad, match in (([5, 1.5, 3], "1.5"), ([5, "17", 3], "'17'"), ([1 << 64], "int64")):
        with pytest.raises(ValueError, match=match):
            engine.chunk_id(bad)


def test_request_past_the_model_limit(tmp_path):
    eng = Engine.load(write_tiny(tmp_path / "m", max_position_embeddings=64))
    with pytest.raises(ValueError, match="past the model's limit of 64"):
        eng.prefill([[1] * 40], [2] * 30)
    with pytest.raises(ValueError, match="past the model's limit"):
        eng.generate([[1] * 40], [2] * 10, max_new_tokens=20)
    assert len(eng.cache) == 0


def test_offset_the_metadata_cannot_encode(engine, monkeypatch):
    """A chunk starting past what the offset field holds is refused up front, nothing computed. The field holds
    every position a model addresses (2**24 - 1), so the test narrows it to 40 to reach the check."""
    import kernels.paged_attention as pa
    from services.engine import engine as engine_module

    monkeypatch.setattr(pa, "MAX_OFFSET", 40)
    monkeypatch.setattr(engine_module, "MAX_OFFSET", 40)
    before = _snapshot(engine)
    chunks = [[1] * 41, [2] * 4]
    with pytest.raises(ValueError, match="offset 41 does not fit the 24-bit offset field"):
        engine.prefill(chunks, [3], mode="tessera")
    assert _snapshot(engine) == before


def test_unsupported_architecture_and_rope_are_refused_by_name(tmp_path):
    d = write_tiny(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        Engine.load(d)
    (d / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    with pytest.raises(ValueError, match="unsupported rope type 'yarn'"):
        Engine.load(d)


def test_bad_sampling_values(engine):
    chunks, suffix = random_request(21)
    for kwargs, match in ((dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
                          (dict(max_new_tokens=0), "max_new_tokens")):
        with pytest.raises(ValueError, match=match):
            engine.generate(chunks, suffix, **kwargs)


def test_one_layer_model_serves_every_mode_that_needs_no_check_layer(tmp_path):
    eng = Engine.load(write_tiny(tmp_path / "one", num_layers=1))
    chunks, suffix = random_request(22)
    full = eng.prefill(chunks, suffix, mode="full").logits
    torch.testing.assert_close(eng.prefill(chunks, suffix, mode="prefix").logits, full)
    assert torch.isfinite(eng.prefill(chunks, suffix, mode="tessera", recompute_ratio=0).logits).all()
    with pytest.raises(ValueError, match="check layer below the model's 1 layers"):
        eng.prefill(chunks, suffix, mode="tessera", recompute_ratio=0.15)


def test_triton_backend_on_the_cpu_needs_the_interpreter(tiny_dir, monkeypatch):
    """Without Triton's interpreter a CPU engine refuses the Triton attention backend by name (its kernels
    would fail on the first CPU tensor they meet)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        Engine.load(tiny_dir, attention_backend="triton")


def test_a_pool_the_metadata_cannot_address_is_refused(tiny_dir, monkeypatch):
    """More blocks than the block-id field holds: refused when the engine is built, naming the bytes that fit."""
    from services.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "MAX_BLOCK_ID", 99)
    with pytest.raises(ValueError, match=r"makes \d+ blocks .* addresses 100 \(give at most"):
        Engine.load(tiny_dir, kv_cache_bytes=256 << 20)
    Engine.load(tiny_dir, kv_cache_bytes=1 << 20)  # few enough blocks: built
