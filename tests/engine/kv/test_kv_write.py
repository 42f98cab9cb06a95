"""The layer passes store K/V inside the q|k|v kernel (KVWrite): the same bits as a separate write, only
into the pass's own slots, padded rows of static tails and decode steps into the scratch block only.

Each check runs with the plain-torch twins and with the Triton kernels (interpreted on the CPU)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from services.engine import Engine
from services.engine.kv.block_pool import BlockPool
from services.engine.model.layers import Transformer
from services.engine.model.tiny import random_weights, tiny_config
from services.engine.model.weights import weights_from_tensors

from ..conftest import random_request, tail_replays

KERNELS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU Triton kernels need triton and its interpreter (TRITON_INTERPRET=1)"))]


def _use_kernels(eng: Engine, kernels: str) -> Engine:
    eng.forward.model.kernels = kernels
    eng.pool.kernels = kernels
    return eng


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_write_equals_separate_write(arch, kernels):
    """attention_inputs(write=...) leaves the pool exactly as attention_inputs then BlockPool.write, and
    returns the same q; slots scattered over blocks, another layer's cache untouched."""
    cfg = tiny_config(arch)
    w = weights_from_tensors(random_weights(cfg, 5), cfg, torch.device("cpu"), torch.float32)
    model = Transformer(cfg, w, rope_backend="triton", kernel_backend=kernels)
    pools = []
    for _ in range(2):
        pool = BlockPool(2, 6, 4, cfg.num_kv_heads, cfg.head_dim, torch.device("cpu"), torch.float32)
        pool.kernels = kernels
        for t in pool.k + pool.v:
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(9)))
        pools.append(pool)
    h, pos = torch.randn(7, cfg.hidden_size), torch.arange(30, 37)
    flat = torch.tensor([21, 2, 13, 8, 0, 17, 6])
    block, slot = flat // 4, flat % 4
    q, k, v = model.attention_inputs(1, h, pos)
    pools[0].write(1, block, slot, k, v)
    q2, k2, v2 = model.attention_inputs(1, h, pos, write=pools[1].at(1, block, slot))
    assert k2 is None and v2 is None and torch.equal(q2, q)
    for a, b in zip(pools[0].k + pools[0].v, pools[1].k + pools[1].v):
        assert torch.equal(a, b)
    assert torch.equal(pools[1].k[1][block, slot], k) and torch.equal(pools[1].v[1][block, slot], v)


def _snapshot(pool: BlockPool) -> list[torch.Tensor]:
    return [t.clone() for t in pool.k + pool.v]


def _changed_blocks(pool: BlockPool, before: list[torch.Tensor]) -> set[int]:
    changed = set()
    for now, then in zip(pool.k + pool.v, before):
        changed |= set((now != then).flatten(1).any(1).nonzero().flatten().tolist())
    return changed


def _mark_scratch(eng: Engine) -> None:
    """A value no pass writes, so that padded rows' writes into the scratch block show."""
    for t in eng.pool.k + eng.pool.v:
        t[eng.forward.scratch_block] = 1e4


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return Engine.load(tiny_dir, static_tails=False)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("ratio", [0.0, 0.3])
@pytest.mark.slow
def test_static_tail_writes_only_its_slots_and_scratch(tiny_dir, reference, kernels, ratio):
    """A static-tail pass over resident chunks (ratio 0.3: the check layer's half-done first layer too)
    changes only the request's private blocks and, through its padded rows, the scratch block: never a
    shared chunk block. Its logits equal the eager twin pass."""
    eng = Engine.load(tiny_dir, static_tails=True)
    chunks, suffix = random_request(90, lengths=(13, 21, 9), suffix_len=5)
    eng.prefill(chunks, suffix, mode="tessera", recompute_ratio=ratio)  # chunks computed and cached
    _use_kernels(eng, kernels)  # (only the pass under test interpreted: the interpreter is slow)
    _mark_scratch(eng)
    before = _snapshot(eng.pool)
    logits, seq, stats = eng._prefill(chunks, suffix, "tessera", ratio)
    try:
        assert stats.chunk_hits == 3 and tail_replays(eng) >= 2
        changed = _changed_blocks(eng.pool, before)
        assert eng.forward.scratch_block in changed  # the padded rows wrote there (5 rows in a bucket of 16)
        assert changed <= set(seq.private_blocks) | {eng.forward.scratch_block}
        want = reference.prefill(chunks, suffix, mode="tessera", recompute_ratio=ratio).logits
        torch.testing.assert_close(logits, want, rtol=2e-4, atol=2e-4)
    finally:
        eng.release(seq)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.slow
def test_static_decode_writes_only_its_slots_and_scratch(tiny_dir, reference, kernels):
    """A decode step of 3 sequences replayed on static buffers (a bucket of 4: one padded row) writes
    each new token's K/V into its sequence's generated block and the padded row's into the scratch
    block, nothing else; the logits equal the eager twin step's."""
    eng = Engine.load(tiny_dir, static_tails=True, block_size=4)
    ref = Engine.load(tiny_dir, static_tails=False, block_size=4)
    seqs, ref_seqs, tokens = [], [], []
    for seed, ratio in ((91, 0.0), (92, 0.3), (93, 0.0)):
        chunks, suffix = random_request(seed, lengths=(9, 6), suffix_len=3)
        logits, seq, _ = eng._prefill(chunks, suffix, "tessera", ratio)
        seqs.append(seq)
        ref_seqs.append(ref._prefill(chunks, suffix, "tessera", ratio)[1])
        tokens.append(int(logits.argmax()))
    _use_kernels(eng, kernels)  # for the steps under test
    try:
        for step in range(2):
            _mark_scratch(eng)
            before = _snapshot(eng.pool)
            out = eng.decode_step(seqs, tokens)
            changed = _changed_blocks(eng.pool, before)
            assert eng.forward.decode_graphs.replays == step + 1
            assert eng.forward.scratch_block in changed
            assert changed <= {b for s in seqs for b in s.gen_blocks} | {eng.forward.scratch_block}
            torch.testing.assert_close(out, ref.decode_step(ref_seqs, tokens), rtol=2e-4, atol=2e-4)
            tokens = out.argmax(-1).tolist()
    finally:
        for s in seqs:
            eng.release(s)
        for s in ref_seqs:
            ref.release(s)
