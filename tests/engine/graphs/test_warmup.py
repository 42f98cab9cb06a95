"""The serving warm-up (services/engine/graphs/warmup.py) on the CPU, where the workers skip it but the code path is the
same: it reaches every batch bucket, runs each pass, fits the model's limits, and leaves nothing behind."""

from __future__ import annotations

import pytest
import torch

from services.cluster.config import DecodeSettings, PrefillSettings
from services.engine import Engine
from services.engine.model.tiny import random_weights, tiny_config
from services.engine.graphs.warmup import DECODE_STEPS, warm_decode, warm_prefill


def _engine(**cfg_overrides) -> Engine:
    cfg = tiny_config("llama", **cfg_overrides)
    return Engine.from_state_dict(cfg, random_weights(cfg, 0), device="cpu", dtype=torch.float32)


def _spy_steps(eng) -> list[int]:
    sizes: list[int] = []
    step = eng.decode_step

    def counted(seqs, tokens):
        sizes.append(len(seqs))
        return step(seqs, tokens)

    eng.decode_step = counted
    return sizes


@pytest.mark.parametrize("max_batch, want", [(32, [1, 2, 4, 8, 16, 32]), (3, [1, 2, 3]), (1, [1])])
def test_decode_warm_up_steps_every_bucket_the_batcher_reaches_and_leaves_nothing(max_batch, want):
    eng = _engine()
    sizes = _spy_steps(eng)
    free = eng.pool.num_free
    done = warm_decode(eng, max_batch, context_tokens=600, only_cuda=False)
    assert done["batches"] == want and done["policies"] == ["quest", "retro", "dense", "retrieval"]   # dense before retrieval
    assert done["layer_graph_batches"] == want
    assert sizes == [b for _ in done["policies"] for b in want for _ in range(DECODE_STEPS)]
    assert done["context_tokens"] == 600 and done["seconds"] > 0
    assert eng.pool.num_free == free and eng.cache.keys() == []


def test_decode_warm_up_takes_the_sparse_policies_it_is_given():
    eng = _engine()
    sizes = _spy_steps(eng)
    quest = eng.decode_policy("quest", budget_tokens=64, dense_layers=1)
    done = warm_decode(eng, 2, context_tokens=300, only_cuda=False, sparse=[quest])
    assert done["policies"] == ["quest", "dense"] and sizes == [1, 1, 2, 2] * 2


def test_prefill_warm_up_runs_each_pass_and_leaves_nothing():
    eng = _engine()
    free = eng.pool.num_free
    done = warm_prefill(eng, (0.0, 0.15), context_tokens=1100, only_cuda=False)
    assert done["passes"] == ["full@0.0", "prefix@0.0", "position_aware@0.0", "blend_copy@0.15", "tessera@0.0",
                              "tessera@0.15"]
    assert done["context_tokens"] == 1100
    assert eng.pool.num_free == free and eng.cache.keys() == []


def test_warm_up_is_skipped_off_the_gpu_unless_asked():
    eng = _engine()
    sizes = _spy_steps(eng)
    assert warm_decode(eng, 32)["batches"] == [] and sizes == []
    assert warm_prefill(eng)["passes"] == []


def test_the_made_up_context_fits_the_model_and_the_pool():
    eng = _engine(max_position_embeddings=256)
    done = warm_decode(eng, 4, context_tokens=4096, only_cuda=False)
    assert done["batches"] == [1, 2, 4] and done["context_tokens"] <= 256 - 1 - DECODE_STEPS * 3 * 3
    small = _engine()
    small_pool = Engine.from_state_dict(small.cfg, random_weights(small.cfg, 0), device="cpu", dtype=torch.float32,
                                        kv_cache_bytes=64 * small.pool.block_bytes)
    free = small_pool.pool.num_free
    done = warm_prefill(small_pool, (0.0,), context_tokens=4096, only_cuda=False)
    assert 0 < done["context_tokens"] <= (free // 2 - 4) // 3 * small_pool.block_size
    assert "stopped" not in done and done["passes"] == ["full@0.0", "prefix@0.0", "position_aware@0.0", "tessera@0.0"]
    assert small_pool.pool.num_free == free and small_pool.cache.keys() == []


def test_a_pool_too_small_for_the_batch_stops_the_warm_up_and_leaves_nothing():
    small = _engine()
    eng = Engine.from_state_dict(small.cfg, random_weights(small.cfg, 0), device="cpu", dtype=torch.float32,
                                 kv_cache_bytes=40 * small.pool.block_bytes)
    free = eng.pool.num_free
    done = warm_decode(eng, 32, context_tokens=4096, only_cuda=False)
    assert "KV memory exhausted" in done["stopped"] and 32 not in done["batches"]
    assert eng.pool.num_free == free and eng.cache.keys() == []
    assert eng.generate([[3, 4, 5]], [6, 7], max_new_tokens=2, mode="tessera", recompute_ratio=0.0)  # still serves


def test_outputs_after_a_warm_up_are_those_of_a_cold_engine():
    chunks = [[5, 9, 14, 2] * 20, [7, 3, 11] * 30]
    suffix = [4, 8, 15, 16, 23, 42]
    cold = _engine().generate(chunks, suffix, max_new_tokens=6, mode="tessera", recompute_ratio=0.15)
    eng = _engine()
    warm_decode(eng, 8, context_tokens=300, only_cuda=False)
    warm_prefill(eng, (0.0, 0.15), context_tokens=300, only_cuda=False)
    assert eng.generate(chunks, suffix, max_new_tokens=6, mode="tessera", recompute_ratio=0.15) == cold


def test_warm_up_settings_are_validated():
    with pytest.raises(ValueError, match="warmup_tokens"):
        DecodeSettings(warmup_tokens=-1)
    with pytest.raises(ValueError, match="warmup_tokens"):
        PrefillSettings(warmup_tokens=-1)
    with pytest.raises(ValueError, match="max_batch"):
        warm_decode(_engine(), 0, only_cuda=False)


def test_a_failing_warm_up_is_logged_and_the_worker_goes_on(caplog):
    import asyncio

    from services.engine.graphs.warmup import warm_up

    def broken(eng):
        raise RuntimeError("no kernel for this GPU")

    with caplog.at_level("WARNING"):
        assert asyncio.run(warm_up("tessera-decode-0", broken, None)) is None
    assert "tessera-decode-0: warm-up failed" in caplog.text and "no kernel for this GPU" in caplog.text
    done = asyncio.run(warm_up("tessera-prefill-0", lambda: {"passes": [], "stopped": "KV memory exhausted"}))
    assert done["stopped"] == "KV memory exhausted" and "stopped early (KV memory exhausted)" in caplog.text


def test_decode_warm_up_makes_the_graphs_between_a_retrieval_steps_attentions():
    """With static tails on, the warm-up's retrieval decode (retrieving nothing: no index is searched or offloaded
    to) steps through the layer graphs of every bucket, as a real retrieval request then does, and leaves nothing."""
    cfg = tiny_config("llama")
    eng = Engine.from_state_dict(cfg, random_weights(cfg, 0), device="cpu", dtype=torch.float32, static_tails=True)
    free = eng.pool.num_free
    done = warm_decode(eng, 3, context_tokens=600, only_cuda=False)
    assert done["policies"][-1] == "retrieval" and done["layer_graph_batches"] == [1, 2, 3]
    assert sorted(eng.forward.layer_graphs.sets) == [1, 2, 4] and eng.forward.layer_graphs.steps == 3 * DECODE_STEPS
    assert eng.forward.indexes is None and eng.pool.num_free == free and eng.cache.keys() == []
