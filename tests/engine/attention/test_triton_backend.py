"""The engine's equivalences hold with the fused Triton kernels too (interpreted on the CPU).

The torch-backend engine is the reference here: it is itself checked against transformers.
Shapes stay small because the interpreter is slow.
"""

from __future__ import annotations

import pytest
import torch

from services.engine import Engine

from ..conftest import cpu_triton, random_request

pytest.importorskip("triton")
TOL = dict(rtol=2e-4, atol=2e-4)


@pytest.fixture(scope="module")
def engines(tiny_dirs):
    cpu_triton()
    return (Engine.load(tiny_dirs["llama"], attention_backend="torch"),
            Engine.load(tiny_dirs["llama"], attention_backend="triton"))


@pytest.mark.parametrize("mode, ratio", [("full", 0.0), ("tessera", 0.0), ("tessera", 0.3), ("tessera", 1.0),
                                         ("blend_copy", 0.3)])
def test_triton_prefill_equals_torch(engines, mode, ratio):
    ref, tri = engines
    chunks, suffix = random_request(50, lengths=(13, 21, 9), suffix_len=5)
    a = ref.prefill(chunks, suffix, mode=mode, recompute_ratio=ratio)
    b = tri.prefill(chunks, suffix, mode=mode, recompute_ratio=ratio)
    assert a.stats.tokens_recomputed == b.stats.tokens_recomputed
    torch.testing.assert_close(b.logits, a.logits, **TOL)


@pytest.mark.slow
def test_triton_ratio_one_equals_full_and_decode_matches(engines):
    ref, tri = engines
    chunks, suffix = random_request(51, lengths=(11, 18), suffix_len=4)
    torch.testing.assert_close(tri.prefill(chunks, suffix, mode="tessera", recompute_ratio=1.0).logits,
                               tri.prefill(chunks, suffix, mode="full").logits, **TOL)
    assert tri.generate(chunks, suffix, max_new_tokens=4, stop_token_ids=[]) == \
        ref.generate(chunks, suffix, max_new_tokens=4, stop_token_ids=[])


@pytest.mark.parametrize("mode, ratio", [("full", 0.0), ("tessera", 0.3), ("tessera", 0.0)])
@pytest.mark.slow
def test_plain_causal_passes_take_the_flash_path(engines, monkeypatch, mode, ratio):
    """The passes the caller calls plain causal (full, a chunk computed alone) skip the paged kernel; a ratio-0
    pass needs it for every layer. The layers before the check layer never take it: their tokens attend their
    own fresh K/V (attention.self_causal). The logits agree with the torch backend's."""
    from kernels.paged_attention import triton as kt

    ref, tri = engines
    chunks, suffix = random_request(52, lengths=(13, 21, 9), suffix_len=5)
    tri.prefill(chunks, suffix, mode=mode, recompute_ratio=ratio)  # the chunks cached: no chunk computed below
    calls = []
    paged = kt.paged_prefill_packed
    monkeypatch.setattr(kt, "paged_prefill_packed", lambda *a, **k: (calls.append(1), paged(*a, **k))[1])
    got = tri.prefill(chunks, suffix, mode=mode, recompute_ratio=ratio).logits
    layers = tri.cfg.num_layers
    if mode == "full":
        assert len(calls) == 0
    elif ratio > 0:
        assert len(calls) == layers - tri.blend.check_layer  # the check layer on: selected tokens, not causal
    else:
        assert len(calls) == layers
    torch.testing.assert_close(got, ref.prefill(chunks, suffix, mode=mode, recompute_ratio=ratio).logits, **TOL)
