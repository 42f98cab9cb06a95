"""Host work of the reuse passes: no op that makes the host wait for the GPU, few ops before the GPU
gets its first real work, host-side table facts that agree with the device, memos that follow evictions.

On the CPU a sync cannot be observed, so the ops that cause one on CUDA are caught by name with a
dispatch mode: a local scalar read (item/tolist/bool of a tensor), nonzero/equal, and a Python scalar
written into one element (``t[i] = x`` copies a 0-dim host tensor, which waits for the GPU).
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from services.engine import Engine

from ..conftest import cpu_triton, random_request, tail_replays

SYNCING = {"_local_scalar_dense", "nonzero", "equal", "is_nonzero", "masked_select"}


class OpLog(TorchDispatchMode):
    """Ops dispatched: (op name, engine file:line it came from, whether a model op has run yet)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, str, bool]] = []
        self.model_started = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        frame, site = sys._getframe(1), "?"
        while frame is not None:
            name = frame.f_code.co_filename
            if "/services/engine/" in name or "/kernels/" in name:
                # the path from services/ or the repository root: engine/graphs/tails.py:NN, kernels/rope/...
                rel = name.split("/services/", 1)[1] if "/services/engine/" in name else "kernels/" + name.split("/kernels/", 1)[1]
                site = f"{rel}:{frame.f_lineno}"
                if frame.f_code.co_qualname.startswith("Transformer."):
                    self.model_started = True
                break
            frame = frame.f_back
        base = func._schema.name.split("::")[-1]
        scalar_set = (base in ("copy_", "index_put_") and len(args) > 1 and isinstance(args[1], torch.Tensor)
                      and args[1].dim() == 0 and (base == "index_put_" or args[0].dim() == 0))
        kind = "sync" if base in SYNCING or scalar_set else ("view" if func.is_view else base)
        self.ops.append((kind, site, self.model_started))
        return out


def _logged(eng, chunks, suffix, mode, ratio):
    eng.prefill(chunks, suffix, mode=mode, recompute_ratio=ratio)  # chunks resident, tails built
    log = OpLog()
    with log:
        eng.prefill(chunks, suffix, mode=mode, recompute_ratio=ratio)
    return log


@pytest.mark.parametrize("ratio", [0.0, 0.15, 1.0])
@pytest.mark.parametrize("static", [False, True])
def test_tessera_pass_never_syncs(tiny_dir, ratio, static):
    eng = Engine.load(tiny_dir, static_tails=static)
    chunks, suffix = random_request(70, lengths=(20, 33, 17))
    log = _logged(eng, chunks, suffix, "tessera", ratio)
    assert [site for kind, site, _ in log.ops if kind == "sync"] == []


@pytest.mark.slow
def test_triton_tessera_pass_never_syncs_in_engine_code(tiny_dirs):
    """The engine's own code; kernels/paged_attention's packing is checked by its owners."""
    cpu_triton()
    eng = Engine.load(tiny_dirs["llama"], attention_backend="triton", static_tails=True)
    chunks, suffix = random_request(71, lengths=(13, 21, 9), suffix_len=5)
    log = _logged(eng, chunks, suffix, "tessera", 0.3)
    assert [site for kind, site, _ in log.ops if kind == "sync" and site.startswith("engine/")] == []


@pytest.mark.parametrize("ratio", [0.0, 0.15])
@pytest.mark.slow
def test_few_launches_before_the_first_model_op(tiny_dir, ratio):
    """Everything before the embedding (tables, slots, ids) is one host-to-device copy and a few ops: at
    ratio 0 and ratio > 0 alike the pass is one copy into its graph's inputs, then the graph (run eagerly on
    the CPU: its body's ops are counted)."""
    eng = Engine.load(tiny_dir, static_tails=True)
    chunks, suffix = random_request(72, lengths=(20, 33, 17, 40, 9))
    log = _logged(eng, chunks, suffix, "tessera", ratio)
    before = [(kind, site) for kind, site, started in log.ops if not started and kind not in ("view", "empty")]
    assert len(before) <= 3, before
    fill = [kind for kind, site, _ in log.ops if site.startswith("engine/graphs/") and kind != "view"]
    assert 0 < len(fill) <= 40 * (eng.cfg.num_layers + 1)  # the tail body (eager on the CPU) included
    assert tail_replays(eng) > 0


def _popcount(masks: torch.Tensor) -> int:
    bits = torch.arange(64, dtype=torch.int64)
    return int(((masks[:, None] >> bits) & 1).sum())


@pytest.mark.parametrize("mode, ratio, check_layer", [("tessera", 0.0, 1), ("tessera", 0.3, 1), ("tessera", 1.0, 1),
                                                      ("tessera", 0.3, 2), ("blend_copy", 0.3, 1),
                                                      ("position_aware", 0.3, 1)])
@pytest.mark.slow
def test_host_side_table_facts_match_the_device(tiny_dir, mode, ratio, check_layer):
    """visible (the count that sizes the keys without a sync), max_offset and the int64 id rows that
    static tails copy agree with the tables' device tensors, for every layer's table."""
    eng = Engine.load(tiny_dir, check_layer=check_layer)
    chunks, suffix = random_request(73, lengths=(20, 33, 17))
    chunks, suffix, ids, _ = eng._validate(chunks, suffix, mode, ratio)
    logits, seq, _ = eng._prefill(chunks, suffix, mode, ratio, ids=ids)
    try:
        for table in {id(t): t for t in seq.layer_tables}.values():
            assert table.visible == _popcount(table.masks)
            assert table.max_offset == int(table.offsets.max())
            if table.id_rows is not None:
                assert torch.equal(table.id_rows[0], table.block_ids.long())
                assert torch.equal(table.id_rows[1], table.offsets.long())
    finally:
        eng.release(seq)


@pytest.mark.slow
def test_memoised_chunk_slots_follow_eviction_and_block_reuse(tiny_dir):
    """A chunk's slot index is memoised on its cache entry; once evicted, its blocks go to other chunks
    and the chunk comes back in other blocks: its new entry must not use the old memo."""
    ref = Engine.load(tiny_dir)
    eng = Engine.load(tiny_dir)
    a, suffix = random_request(74, lengths=(20, 33))
    b, _ = random_request(75, lengths=(33, 20))
    first = eng.prefill(a, suffix, mode="tessera", recompute_ratio=0.3)
    entries = [eng.cache.acquire(eng.chunk_id(c)) for c in a]
    old_blocks = {blk for e in entries for blk in e.blocks}
    assert all(e.slots is not None for e in entries)
    for e in entries:
        eng.cache.release(e)
    eng.cache.clear()  # a's chunks evicted, their blocks free
    b, suffix, ids, _ = eng._validate(b, suffix, "tessera", 0.3)
    _, held, _ = eng._prefill(b, suffix, "tessera", 0.3, ids=ids)  # b pinned in a's blocks
    try:
        assert old_blocks & {blk for e in held.pinned for blk in e.blocks}
        again = eng.prefill(a, suffix, mode="tessera", recompute_ratio=0.3)
        entries = [eng.cache.acquire(eng.chunk_id(c)) for c in a]
        assert not old_blocks & {blk for e in entries for blk in e.blocks}
        for e in entries:
            eng.cache.release(e)
    finally:
        eng.release(held)
    want = ref.prefill(a, suffix, mode="tessera", recompute_ratio=0.3).logits
    torch.testing.assert_close(first.logits, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(again.logits, want, rtol=1e-4, atol=1e-4)
    assert again.stats.chunk_misses == 2


def test_memoised_chunk_slots_name_the_entry_blocks(tiny_dir):
    eng = Engine.load(tiny_dir)
    chunks, suffix = random_request(76, lengths=(20, 33, 17))
    eng.prefill(chunks, suffix, mode="tessera", recompute_ratio=0.3)
    for c in chunks:
        entry = eng.cache.acquire(eng.chunk_id(c))
        try:
            assert entry.slots is not None
            want = [blk * eng.block_size + j for blk in entry.blocks for j in range(eng.block_size)][:entry.length]
            assert entry.slots.tolist() == want
        finally:
            eng.cache.release(entry)


def test_host_to_device_many_keeps_dtypes_shapes_and_values():
    """One staged copy carries int64 and int32 arrays of any shape (empty ones too) in any order; each comes
    back as its own tensor with its values; other dtypes are refused by name."""
    import numpy as np

    from services.engine.kv.block_table import host_to_device_many

    rng = np.random.default_rng(0)
    arrays = [rng.integers(-9, 9, 5, dtype=np.int32), rng.integers(-2**40, 2**40, (2, 3), dtype=np.int64),
              np.zeros(0, dtype=np.int64), rng.integers(0, 7, (3, 1), dtype=np.int32), np.arange(7)[::2]]
    out = host_to_device_many(arrays, torch.device("cpu"))
    for a, t in zip(arrays, out):
        assert t.dtype == {np.int32: torch.int32, np.int64: torch.int64}[a.dtype.type] and tuple(t.shape) == a.shape
        assert torch.equal(t, torch.from_numpy(np.ascontiguousarray(a)))
    with pytest.raises(ValueError, match="float64"):
        host_to_device_many([np.zeros(3)], torch.device("cpu"))
