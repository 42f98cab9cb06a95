"""Static-shape layer tails (the code CUDA graphs capture) equal the eager passes; padding is inert."""

from __future__ import annotations

import pytest
import torch

from services.engine import Engine

from ..conftest import cpu_triton, random_request, tail_replays


@pytest.mark.parametrize("mode, ratio", [("tessera", 0.0), ("tessera", 0.15), ("tessera", 1.0), ("prefix", 0.0),
                                         ("full", 0.0), ("blend_copy", 0.3), ("position_aware", 0.15)])
def test_static_tail_equals_eager(tiny_dir, mode, ratio):
    eager = Engine.load(tiny_dir, static_tails=False)
    static = Engine.load(tiny_dir, static_tails=True)
    for seed in (40, 41):  # the second request reuses the tail buckets of the first, refilled
        chunks, suffix = random_request(seed, lengths=(20, 33, 17), suffix_len=5 + seed - 40)
        a = eager.prefill(chunks, suffix, mode=mode, recompute_ratio=ratio).logits
        b = static.prefill(chunks, suffix, mode=mode, recompute_ratio=ratio).logits
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert tail_replays(static) >= 2


@pytest.mark.parametrize("block_size", [7, 64])
def test_static_tail_other_block_sizes(tiny_dir, block_size):
    """Blocks that do not divide the key bucket (7) or hold masks past 16 bits (64): entries padded,
    hidden twins masked, all slots of a block gathered."""
    eager = Engine.load(tiny_dir, static_tails=False, block_size=block_size)
    static = Engine.load(tiny_dir, static_tails=True, block_size=block_size)
    computed = 0
    for seed in (43, 44):
        chunks, suffix = random_request(seed, lengths=(20, 33, 17), suffix_len=4)
        for ratio in (0.0, 0.3):
            a = eager.prefill(chunks, suffix, mode="tessera", recompute_ratio=ratio).logits
            b = static.prefill(chunks, suffix, mode="tessera", recompute_ratio=ratio)
            computed += b.stats.chunk_misses
            torch.testing.assert_close(b.logits, a, rtol=1e-4, atol=1e-4)
    # one replay per pass, and one per chunk computed alone (its layers replayed as a tail too)
    assert computed == 6 and tail_replays(static) == 4 + computed
    assert static.forward.id_tails.replays == 2  # the ratio-0 passes: one copy and one replay each


def test_static_tails_keep_decode_exact(tiny_dir):
    eager = Engine.load(tiny_dir, static_tails=False)
    static = Engine.load(tiny_dir, static_tails=True)
    chunks, suffix = random_request(42)
    assert static.generate(chunks, suffix, max_new_tokens=8, stop_token_ids=[]) == \
        eager.generate(chunks, suffix, max_new_tokens=8, stop_token_ids=[])
    # the scratch block that padded rows write to is never handed to a request
    assert static.forward.scratch_block in static.pool.reserved


@pytest.fixture(scope="module")
def triton_engines(tiny_dirs):
    cpu_triton()
    return (Engine.load(tiny_dirs["llama"], attention_backend="triton", static_tails=False),
            Engine.load(tiny_dirs["llama"], attention_backend="triton", static_tails=True))


@pytest.mark.parametrize("mode, ratio", [("tessera", 0.0), ("tessera", 0.3)])  # prefix runs the same code as 0.0
@pytest.mark.slow
def test_triton_static_tail_equals_eager(triton_engines, mode, ratio):
    """The tail through the Triton kernel (padded table, packed into fixed buffers) == the eager Triton pass."""
    eager, static = triton_engines
    before, computed = tail_replays(static), 0
    # the second request is shorter (fewer entries and tokens, same buckets): stale entries and rows stay inert
    for seed, lengths, suffix_len in ((60, (13, 21, 9), 6), (61, (11, 9), 3)):
        chunks, suffix = random_request(seed, lengths=lengths, suffix_len=suffix_len)
        a = eager.prefill(chunks, suffix, mode=mode, recompute_ratio=ratio)
        b = static.prefill(chunks, suffix, mode=mode, recompute_ratio=ratio)
        computed += b.stats.chunk_misses
        assert a.stats.tokens_recomputed == b.stats.tokens_recomputed
        torch.testing.assert_close(b.logits, a.logits, rtol=2e-4, atol=2e-4)
    assert tail_replays(static) == before + 2 + computed   # chunks computed alone replay tails too
    tails = [*static.forward.tails.tails.values(), *static.forward.id_tails.tails.values()]
    assert all(type(t.attention).__name__ == "TritonStatic" for t in tails)


def test_static_tail_refilled_by_shorter_and_longer_requests(tiny_dir):
    """One bucket serves a long, a short, then a long request again: rows and entries of the longer
    request that the shorter one does not overwrite go back to padding (inert), and come back in use."""
    eager = Engine.load(tiny_dir, static_tails=False)
    static = Engine.load(tiny_dir, static_tails=True)
    for seed, lengths, suffix_len in ((80, (20, 33, 17), 9), (81, (20, 9), 2), (82, (17, 33, 20), 8)):
        chunks, suffix = random_request(seed, lengths=lengths, suffix_len=suffix_len)
        for ratio in (0.0, 0.3):
            a = eager.prefill(chunks, suffix, mode="tessera", recompute_ratio=ratio).logits
            b = static.prefill(chunks, suffix, mode="tessera", recompute_ratio=ratio).logits
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert len(static.forward.tails.tails) < static.forward.tails.replays  # buckets were reused
    assert len(static.forward.id_tails.tails) < static.forward.id_tails.replays
