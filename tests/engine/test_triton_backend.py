"""The engine's equivalences hold with the fused Triton kernels too (interpreted on the CPU).

The torch-backend engine is the reference here: it is itself checked against transformers.
Shapes stay small because the interpreter is slow.
"""

from __future__ import annotations

import pytest
import torch

from services.engine import Engine

from .conftest import cpu_triton, random_request

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


def test_triton_ratio_one_equals_full_and_decode_matches(engines):
    ref, tri = engines
    chunks, suffix = random_request(51, lengths=(11, 18), suffix_len=4)
    torch.testing.assert_close(tri.prefill(chunks, suffix, mode="tessera", recompute_ratio=1.0).logits,
                               tri.prefill(chunks, suffix, mode="full").logits, **TOL)
    assert tri.generate(chunks, suffix, max_new_tokens=4, stop_token_ids=[]) == \
        ref.generate(chunks, suffix, max_new_tokens=4, stop_token_ids=[])
