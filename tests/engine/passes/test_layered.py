"""The layer-major prefill of a retrieval decode (services/engine/passes/layered.py): a context larger than the pool is
served, and retrieving every offloaded key it generates what dense decoding of the ordinary pass does; the pool holds
the static set alone; the index set holds the ordinary pass's keys and values; a pass that fails leaves nothing
held; "auto" takes it only where the pool is short, and other modes are refused clearly then."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.engine import Engine
from services.engine.decode import DENSE, RetrievalDecode
from services.engine.kv.block_pool import PoolExhausted
from services.engine.options import EngineOptions
from services.engine.passes import layered

from ..conftest import random_request

SMALL = dict(sink_tokens=4, window_tokens=8)        # most of a ~100-token prompt offloaded (16-token pages)
# (the tiny model's block: 16 slots x 4 layers x K,V x 2 heads x 32 dims x fp32 = 32 KiB, its page bounds 2 KiB)
BLOCK = 16 * 4 * 2 * 2 * 32 * 4 + 2 * 4 * 2 * 32 * 4


def small_engine(tiny_dir, blocks: int, **options) -> Engine:
    """An engine whose pool has ``blocks`` blocks (one of them its static tails' scratch)."""
    return Engine.load(tiny_dir, kv_cache_bytes=blocks * BLOCK, chunk_cache_bytes=BLOCK,
                       options=EngineOptions(**options))


@pytest.mark.parametrize("n,sink,window,want", [
    (100, 4, 8, (16, 80)), (100, 0, 0, (0, 100)), (100, 0, 200, (0, 0)), (100, 16, 84, (16, 16)),
    (100, 128, 8, (100, 100)), (96, 4, 16, (16, 80)), (5, 4, 1, (5, 5))])
def test_static_bounds_are_whole_pages_from_zero(n, sink, window, want):
    got = layered.static_bounds(n, RetrievalDecode(retrieval_k=1, sink_tokens=sink, window_tokens=window), 16)
    assert got == want


@pytest.mark.parametrize("slice_tokens", [16384, 24], ids=["one-slice", "slices-of-24"])
def test_a_context_larger_than_the_pool_generates_what_dense_decoding_does(tiny_dir, monkeypatch, slice_tokens):
    """107 tokens need 7 blocks; the small engine's pool has 4 to give (one more is its scratch). Retrieving every
    offloaded key, its logits are the ordinary engine's dense ones within fp32 tolerance, and so are its tokens."""
    monkeypatch.setattr(layered, "SLICE_TOKENS", slice_tokens)
    chunks, suffix = random_request(51, lengths=(40, 27, 33), suffix_len=7)
    big = Engine.load(tiny_dir)
    dense_logits, seq = big.prefill_sequence(chunks, suffix, mode="full", decode=DENSE, extra_tokens=4)
    dense_logits = torch.stack([dense_logits] + [big.decode_step([seq], [t])[0] for t in (5, 9, 11, 2)])
    big.release(seq)
    dense = big.generate(chunks, suffix, max_new_tokens=8, stop_token_ids=[], mode="full")

    eng = small_engine(tiny_dir, 5)
    with pytest.raises(PoolExhausted):      # the ordinary pass cannot hold it
        eng.generate(chunks, suffix, max_new_tokens=2, stop_token_ids=[], mode="full")
    assert eng.pool.num_free == 4
    policy = RetrievalDecode(retrieval_k=4096, **SMALL)
    logits, seq = eng.prefill_sequence(chunks, suffix, mode="full", decode=policy, extra_tokens=4)
    # the pool holds the static set: the first page and the last two (positions 96..106, the window's 8 from 99)
    assert len(seq.private_blocks) == 2 and eng.pool.num_free == 2
    assert seq.offload.offloaded == [16 * 5] * 4 and seq.offload.static == [2] * 4
    got = torch.stack([logits] + [eng.decode_step([seq], [t])[0] for t in (5, 9, 11, 2)])
    eng.release(seq)
    seq.offload.build.result(timeout=60)      # (a build still running when released drops all once it stops)
    assert eng.pool.num_free == 4 and not eng.forward.indexes._heads
    torch.testing.assert_close(got, dense_logits, rtol=1e-5, atol=1e-5)
    stats = {}
    assert eng.generate(chunks, suffix, max_new_tokens=8, stop_token_ids=[], mode="full", decode="retrieval",
                        retrieval_k=4096, stats=stats, **SMALL) == dense
    assert stats["keys_scanned"] > 0 and eng.pool.num_free == 4


@pytest.mark.parametrize("host_dtype", ["float32", "bfloat16"])
def test_the_index_set_holds_the_ordinary_passs_keys_and_values(tiny_dir, host_dtype):
    """A suffix alone lays out as the layer-major pass lays it (densely from block 0): both offload the same positions,
    and the index set holds the same keys (at their global positions) and values, as fp32 or rounded alike."""
    _, suffix = random_request(52, lengths=(), suffix_len=90)
    policy = RetrievalDecode(retrieval_k=4096, **SMALL)
    held = {}
    for choice in ("never", "always"):
        eng = Engine.load(tiny_dir, options=EngineOptions(layered_prefill=choice, index_host_dtype=host_dtype))
        _, seq = eng.prefill_sequence([], suffix, mode="full", decode=policy)
        seq.offload.build.result(timeout=60)
        heads = eng.forward.indexes._heads
        held[choice] = [[(h.keys, h.values) for h in heads[(seq.offload.owner, layer)]] for layer in range(4)]
        eng.release(seq)
    for ordinary, layer_major in zip(held["never"], held["always"]):
        for (k0, v0), (k1, v1) in zip(ordinary, layer_major):
            assert k0.shape == k1.shape == (16 * 4, 32) and k0.dtype == k1.dtype
            if host_dtype == "float32":
                np.testing.assert_allclose(k1, k0, rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(v1, v0, rtol=1e-5, atol=1e-5)
            else:       # bits: equal but where the fp32 values round across a bf16 step
                assert (k1 == k0).mean() > 0.99 and (v1 == v0).mean() > 0.99


def test_auto_takes_the_ordinary_pass_where_the_pool_can_hold_the_context(tiny_dir, monkeypatch):
    seen = []
    monkeypatch.setattr(layered, "layered_prefill", lambda *a, **k: seen.append(1) or (_ for _ in ()).throw(
        AssertionError("layer-major pass taken")))
    chunks, suffix = random_request(53, lengths=(20, 30), suffix_len=5)
    eng = small_engine(tiny_dir, 12)
    assert eng.generate(chunks, suffix, max_new_tokens=3, stop_token_ids=[], mode="full", decode="retrieval",
                        retrieval_k=4096, **SMALL)
    assert not seen


def test_a_context_larger_than_the_pool_is_refused_clearly_in_other_modes_and_under_never(tiny_dir):
    chunks, suffix = random_request(54, lengths=(40, 27, 33), suffix_len=7)
    eng = small_engine(tiny_dir, 5)
    for mode in ("tessera", "prefix", "blend_copy"):
        with pytest.raises(ValueError, match=f"needs 7 KV blocks, the pool can give 4.*not in mode '{mode}'"):
            eng.generate(chunks, suffix, max_new_tokens=2, mode=mode, decode="retrieval", **SMALL)
    never = small_engine(tiny_dir, 5, layered_prefill="never")
    with pytest.raises(PoolExhausted):
        never.generate(chunks, suffix, max_new_tokens=2, mode="full", decode="retrieval", **SMALL)
    # an ordinary pass the pool cannot hold gives back the blocks it took before it ran short (it kept them once)
    for mode in ("full", "prefix"):
        with pytest.raises(PoolExhausted):
            never.generate(chunks, suffix, max_new_tokens=2, mode=mode)
    for e in (eng, never):
        assert e.pool.num_free == 4 and not e.cache.keys()
    # retrieving nothing (the static set alone) takes the ordinary pass, which the pool cannot hold either
    with pytest.raises(PoolExhausted):
        eng.generate(chunks, suffix, max_new_tokens=2, mode="full", decode="retrieval", retrieval_k=0, **SMALL)
    with pytest.raises(ValueError, match="EngineOptions.layered_prefill must be"):
        EngineOptions(layered_prefill="sometimes")


@pytest.mark.parametrize("where", ["pass", "copy"])
def test_a_pass_that_fails_leaves_nothing_held_and_the_engine_serving(tiny_dir, monkeypatch, where):
    """An error in the pass itself or on the copy thread fails the request; the pool's blocks and the index set are
    as before, and the next request is served."""
    chunks, suffix = random_request(55, lengths=(40, 27, 33), suffix_len=7)
    eng = small_engine(tiny_dir, 5)
    policy = RetrievalDecode(retrieval_k=4096, **SMALL)
    if where == "pass":
        real = eng.forward.model.finish_layer

        def finish(layer, h, attn):
            if layer == 2:
                raise RuntimeError("injected at layer 2")
            return real(layer, h, attn)

        monkeypatch.setattr(eng.forward.model, "finish_layer", finish)
    else:
        real = layered.host_layer
        calls = []

        def host_layer(*args):
            calls.append(1)
            if len(calls) == 2:
                raise MemoryError("injected: no host memory for layer 1")
            return real(*args)

        monkeypatch.setattr(layered, "host_layer", host_layer)
    with pytest.raises((RuntimeError, MemoryError), match="injected"):
        logits, seq = eng.prefill_sequence(chunks, suffix, mode="full", decode=policy, extra_tokens=2)
        try:       # a copy error may come after the pass: the sequence fails when it would step
            eng.decode_step([seq], [1])
        finally:
            eng.release(seq)
    assert eng.pool.num_free == 4
    assert not eng.forward.indexes._heads
    monkeypatch.undo()
    assert len(eng.generate(chunks, suffix, max_new_tokens=3, stop_token_ids=[], mode="full", decode="retrieval",
                            retrieval_k=4096, **SMALL)) == 3
