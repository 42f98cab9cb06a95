"""The hand-off import with its tables built on the host: the same sequence (tables, pinned chunks, private
blocks, pool contents) as the per-layer device import (tests/handoff/handoff_import_reference.py), with no
op that would wait for the GPU."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from services.engine import Engine, Handoff
from services.handoff.imports import _runs, import_layout, import_sequence
from services.handoff.wire import LayerView
from services.engine.kv.loader import StreamedLayer, numbered

from tests.engine.conftest import random_request
from .handoff_import_reference import reference_import

SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "equal", "is_nonzero", "unique", "_unique2",
           "_unique", "unique_dim", "unique_consecutive", "item"}
FREE = {"empty", "empty_strided", "empty_like", "lift_fresh", "alias", "view", "_unsafe_view", "as_strided"}


class Ops(TorchDispatchMode):
    """Names of the aten ops run, and those that index by a boolean mask (a nonzero, a sync on CUDA)."""

    def __init__(self):
        super().__init__()
        self.names, self.launches, self.mask_indexing = [], [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        self.names.append(name)
        if not func.is_view and name not in FREE:
            self.launches.append(name)
        if name.startswith("index") and len(args) > 1 and isinstance(args[1], (list, tuple)):
            self.mask_indexing += any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        return func(*args, **(kwargs or {}))


def _import_both(ref_eng, new_eng, h, fetch=None, ahead: bool = False):
    """Import ``h`` into two engines in the same state, the reference way and the new one (``ahead``: with its
    layout made first, as a decode worker's helper thread does); assert that both end in the same state and return
    the new sequence (released)."""
    ref = reference_import(ref_eng.forward, h, fetch)
    new = import_sequence(new_eng.forward, h, fetch, import_layout(h) if ahead else None)
    try:
        assert new.next_pos == ref.next_pos and new.chunk_tokens == ref.chunk_tokens
        assert [e.key for e in new.pinned] == [e.key for e in ref.pinned]
        assert [e.blocks for e in new.pinned] == [e.blocks for e in ref.pinned]
        assert new.private_blocks == ref.private_blocks
        # layers share a table exactly where the reference's do
        share = lambda seq: [[a is b for b in seq.layer_tables] for a in seq.layer_tables]  # noqa: E731
        assert share(new) == share(ref)
        for a, b in zip(new.layer_tables, ref.layer_tables):
            for name in ("block_ids", "offsets", "masks"):
                x, y = getattr(a, name), getattr(b, name)
                assert x.dtype == y.dtype and x.device == y.device and torch.equal(x, y), name
            assert a.max_offset == b.max_offset
            shown = ((a.masks[:, None] >> torch.arange(new_eng.block_size, device=a.masks.device)) & 1).sum()
            assert a.visible == int(shown)  # the host's count (the reference left it to the device)
        for layer in range(new_eng.cfg.num_layers):
            assert torch.equal(new_eng.pool.k[layer], ref_eng.pool.k[layer])
            assert torch.equal(new_eng.pool.v[layer], ref_eng.pool.v[layer])
        assert torch.equal(new_eng.pool.slot_pos, ref_eng.pool.slot_pos)
        assert new_eng.cache.keys() == ref_eng.cache.keys()
        # and decoding from either gives the same logits
        tok = int(h.logits.argmax())
        for _ in range(2):
            x, y = new_eng.decode_step([new], [tok]), ref_eng.decode_step([ref], [tok])
            assert torch.equal(x, y)
            tok = int(x[0].argmax())
    finally:
        ref_eng.release(ref)
        new_eng.release(new)
    return new


def _handoff(eng, chunks, suffix, mode, ratio):
    _, h = eng.prefill_handoff(chunks, suffix, mode=mode, recompute_ratio=ratio)
    return Handoff.from_bytes(h.to_bytes())   # as a decode worker parses it: host tensors


@pytest.mark.parametrize("mode, ratio", [("tessera", 0.0), ("tessera", 0.15), ("tessera", 1.0), ("full", 0.0),
                                         ("prefix", 0.0), ("blend_copy", 0.3), ("position_aware", 0.2)])
@pytest.mark.slow
def test_import_equals_the_reference(tiny_dir, mode, ratio):
    prefill, a, b = (Engine.load(tiny_dir) for _ in range(3))
    chunks, suffix = random_request(50)
    for _ in range(2):  # chunks computed at the first import, resident at the second
        _import_both(a, b, _handoff(prefill, chunks, suffix, mode, ratio))
    assert b.pool.num_free + sum(len(e.blocks) for e in b.cache._entries.values()) == b.pool.usable_blocks


@pytest.mark.parametrize("block_size, check_layer", [(8, 1), (16, 2), (64, 1), (64, 3)])
def test_import_equals_the_reference_other_layouts(tiny_dir, block_size, check_layer):
    # block sizes that divide no length; bit 63 of a mask in use (BS 64); hidden tokens from layer 2 or 3 on
    prefill = Engine.load(tiny_dir, block_size=block_size, check_layer=check_layer)
    a, b = (Engine.load(tiny_dir, block_size=block_size) for _ in range(2))
    chunks, suffix = random_request(51, lengths=(20, 70, 17, 129))
    for ratio in (0.0, 0.3):
        _import_both(a, b, _handoff(prefill, chunks, suffix, "tessera", ratio))
    # one chunk twice: two refs of one entry at two starts, each with its own hidden tokens
    h = _handoff(prefill, [chunks[0], chunks[1], chunks[0]], suffix, "tessera", 0.5)
    assert [r.chunk_id for r in h.chunks].count(h.chunks[0].chunk_id) == 2
    seq = _import_both(a, b, h)
    assert seq.pinned[0] is seq.pinned[2]


def test_import_of_fetched_and_computed_chunks_equals_the_reference(tiny_dir):
    prefill, a, b = (Engine.load(tiny_dir, block_size=8) for _ in range(3))
    chunks, suffix = random_request(52)
    h = _handoff(prefill, chunks, suffix, "tessera", 0.3)
    store = {prefill.chunk_id(c): prefill.export_chunk(prefill.chunk_id(c)) for c in chunks[1:]}
    # two from the store (through insert_chunk), one computed here
    _import_both(a, b, h, fetch=lambda cid: numbered(store[cid]) if cid in store else None)
    assert all(prefill.chunk_id(c) in b.cache for c in chunks)


def _synthetic(eng, h: Handoff, seed: int, private: bool = True, hidden: bool = True) -> Handoff:
    """``h`` with every layer's hidden and private tokens drawn at random (sorted or not, some layers
    alike, some empty, hidden ones outside every chunk too), and random K/V."""
    g = torch.Generator().manual_seed(seed)
    n_chunk = sum(ref.length for ref in h.chunks)
    n_all = h.next_pos
    cfg = eng.cfg
    layers, last = [], None
    for layer in range(cfg.num_layers):
        if last is not None and layer % 3 == 2:   # the previous layer's view again
            hid, pos = last
        else:
            hid = torch.randperm(n_all, generator=g)[:int(torch.randint(0, n_chunk, (1,), generator=g))] \
                if hidden else torch.zeros(0, dtype=torch.long)
            hid = hid.sort().values
            pool = torch.cat([hid[hid < n_chunk], torch.arange(n_chunk, n_all)])
            pos = pool[torch.randperm(len(pool), generator=g)[:int(torch.randint(0, len(pool) + 1, (1,), generator=g))]]
            pos = (pos if layer % 2 else pos.sort().values) if private else torch.zeros(0, dtype=torch.long)
        last = hid, pos
        k, v = (torch.randn(len(pos), cfg.num_kv_heads, cfg.head_dim, generator=g) for _ in range(2))
        layers.append(LayerView(hid.clone(), pos.clone(), k, v))
    return Handoff(h.model_fingerprint, h.chunks, tuple(layers), h.next_pos, h.logits)


@pytest.mark.parametrize("block_size", [8, 64])
@pytest.mark.slow
def test_awkward_layer_views_equal_the_reference(tiny_dir, block_size):
    prefill, a, b = (Engine.load(tiny_dir, block_size=block_size) for _ in range(3))
    chunks, suffix = random_request(53, lengths=(20, 70, 17))
    h = _handoff(prefill, [chunks[0], chunks[1], chunks[2], chunks[0]], suffix, "tessera", 0.3)
    for seed in range(3):
        _import_both(a, b, _synthetic(b, h, seed), ahead=seed == 1)
    # no private token at any layer: chunk entries only (with and without hidden tokens)
    seq = _import_both(a, b, _synthetic(b, h, 7, private=False))
    assert seq.private_blocks == []
    _import_both(a, b, _synthetic(b, h, 8, private=False, hidden=False))


def test_a_layout_made_ahead_equals_one_made_at_import_and_another_hand_offs_is_refused(tiny_dir):
    prefill, a, b = (Engine.load(tiny_dir, block_size=8) for _ in range(3))
    chunks, suffix = random_request(56, lengths=(20, 70, 17))
    h = _handoff(prefill, chunks, suffix, "tessera", 0.3)
    _import_both(a, b, h, ahead=True)
    other = _handoff(prefill, chunks[:2], suffix, "tessera", 0.3)
    free = b.pool.num_free
    with pytest.raises(ValueError, match="another hand-off"):
        import_sequence(b.forward, h, None, import_layout(other))
    assert b.pool.num_free == free and all(e.refs == 0 for e in b.cache._entries.values())


def test_an_import_with_no_entry_is_refused_and_leaves_nothing(engine):
    chunks, suffix = random_request(54)
    h = _handoff(engine, chunks, suffix, "tessera", 0.0)
    empty = Handoff(h.model_fingerprint, (), _synthetic(engine, h, 0, private=False, hidden=False).layers,
                    h.next_pos, h.logits)
    free = engine.pool.num_free
    for fn in (reference_import, import_sequence):
        with pytest.raises(ValueError, match="at least one entry"):
            fn(engine.forward, empty)
    assert engine.pool.num_free == free and all(e.refs == 0 for e in engine.cache._entries.values())


@pytest.mark.parametrize("mode, ratio", [("tessera", 0.15), ("full", 0.0)])
def test_import_issues_no_syncing_op_and_one_write_per_layer(engine, mode, ratio):
    chunks, suffix = random_request(55)
    engine.prefill(chunks, suffix, mode="tessera")   # chunks resident (full mode's hand-off names none)
    store = {engine.chunk_id(c): engine.export_chunk(engine.chunk_id(c)) for c in chunks}
    h = _handoff(engine, chunks, suffix, mode, ratio)
    n_layers, n_chunks = engine.cfg.num_layers, len(h.chunks)
    launches = {}
    for fetched in (False, True):
        if fetched:
            engine.cache.clear()   # the chunks come from the store, through insert_chunk
        ops = Ops()
        with ops:
            seq = engine.import_handoff(h, fetch=lambda cid: numbered(store[cid]))
        engine.release(seq)
        assert not SYNCING & set(ops.names) and not ops.mask_indexing, ops.names
        launches[fetched] = ops.launches
    # on the CPU the one copy to the device is none: what launches is the private slots' positions and, the parsed
    # hand-off's K/V being views of one buffer (as a received one's are), two index stores a run of layers that
    # share one set of slots (test_write_layers_equals_a_write_a_layer), not two a layer
    runs = len(_runs(import_layout(h).write_of))
    assert runs < n_layers and launches[False] == ["index_put_"] * (2 * runs + 1), launches[False]
    # a fetched chunk: its slots and positions, and two plain copies a layer
    assert len(launches[True]) - len(launches[False]) <= n_chunks * (2 * n_layers + 4), launches[True]
    ref_ops = Ops()
    with ref_ops:
        engine.release(reference_import(engine.forward, h))
    # the reference indexes by a mask once per chunk and distinct table (each a sync on CUDA)
    assert ref_ops.mask_indexing == n_chunks * len(set(map(id, seq.layer_tables)))
    assert len(ref_ops.launches) > 2 * len(launches[False])


@pytest.mark.cuda
@pytest.mark.parametrize("mode, ratio, kv_on_device", [("tessera", 0.15, True), ("full", 0.0, True),
                                                       ("tessera", 0.15, False)])
def test_cuda_import_equals_the_reference_and_never_syncs(tiny_dir, mode, ratio, kv_on_device):
    # one pool size for all three (the default is a share of the GPU memory free at load)
    prefill, a, b = (Engine.load(tiny_dir, device="cuda", dtype=torch.bfloat16, kv_cache_bytes=1 << 28)
                     for _ in range(3))
    chunks, suffix = random_request(56)
    prefill.prefill(chunks, suffix, mode="tessera")   # its chunks resident, to be exported below
    _, h = prefill.prefill_handoff(chunks, suffix, mode=mode, recompute_ratio=ratio, kv_on_device=True)
    torch.cuda.synchronize()
    # as over CUDA IPC (K/V one device buffer) or a byte stream (K/V host tensors of the payload)
    h = Handoff.from_bytes(h.to_bytes(with_kv=False), h.kv_buffer()) if kv_on_device else Handoff.from_bytes(h.to_bytes())
    store = {prefill.chunk_id(c): [StreamedLayer(i, k.cuda(), v.cuda()) for i, (k, v) in enumerate(
        prefill.export_chunk(prefill.chunk_id(c)))] for c in chunks[1:]}
    fetch = lambda cid: iter(store[cid]) if cid in store else None  # noqa: E731
    _import_both(a, b, h, fetch)   # chunk 0 computed, the others fetched
    torch.cuda.synchronize()
    for fetched in (False, True):
        if fetched:
            b.cache.clear()
            b.cache.release(b.forward.compute_chunk(prefill.chunk_id(chunks[0]), chunks[0]))
            torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            seq = b.import_handoff(h, fetch=fetch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        b.release(seq)


class _Checked:
    """A fetched chunk read onto the device and checked later (as kvio.DeviceLayers): its check fails or passes."""

    def __init__(self, layers, ok: bool):
        self.layers, self.ok, self.verified = layers, ok, False

    def __iter__(self):
        return iter(self.layers)

    def verify(self):
        from services.kvstore import ChunkCorruptError

        self.verified = True
        if not self.ok:
            raise ChunkCorruptError("checksum mismatch of the bytes landed")


@pytest.mark.parametrize("ok", [True, False])
def test_a_checked_fetch_is_verified_before_its_chunk_is_written(engine, ok, monkeypatch):
    """A chunk fetched at admission as a device read is verified before the pool takes it: one that fails is
    computed instead (the same sequence either way), one that passes is written, never computed."""
    chunks, suffix = random_request(56)
    engine.prefill(chunks, suffix, mode="tessera")
    store = {engine.chunk_id(c): engine.export_chunk(engine.chunk_id(c)) for c in chunks}
    h = _handoff(engine, chunks, suffix, "tessera", 0.15)
    engine.cache.clear()
    computed, fetched = [], []
    real = engine.forward.compute_chunk
    monkeypatch.setattr(engine.forward, "compute_chunk", lambda cid, toks: computed.append(cid) or real(cid, toks))

    def fetch(cid):
        fetched.append(_Checked(list(numbered(store[cid])), ok))
        return fetched[-1]

    seq = engine.import_handoff(h, fetch=fetch)
    try:
        assert fetched and all(f.verified for f in fetched)
        assert sorted(computed) == ([] if ok else sorted(f"{c}" for c in store))
        for cid in store:   # resident either way, with the chunk's own K/V
            got = engine.export_chunk(cid)
            assert all(torch.allclose(a, b, atol=1e-5) for (ka, va), (kb, vb) in zip(got, store[cid])
                       for a, b in ((ka, kb), (va, vb)))
    finally:
        engine.release(seq)
