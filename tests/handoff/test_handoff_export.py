"""The hand-off export staged around the first token: the same hand-off as the per-table device export
(tests/handoff/handoff_reference.py), with no host read of device data after the first token."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load
from torch.utils._python_dispatch import TorchDispatchMode

from services.engine import Engine
from services.handoff.export import export_sequence, stage_export

from tests.engine.conftest import random_request
from .handoff_reference import reference_export

SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "equal", "is_nonzero", "unique", "_unique2"}


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._schema.name.split("::")[-1])
        return func(*args, **(kwargs or {}))


def _prefilled(eng, chunks, suffix, mode, ratio):
    chunks, suffix, ids, _ = eng._validate(chunks, suffix, mode, ratio)
    logits, seq, _ = eng._prefill(chunks, suffix, mode, float(ratio), ids=ids)
    return logits, seq


def _assert_same(new, ref):
    assert new.chunks == ref.chunks and new.next_pos == ref.next_pos and new.model_fingerprint == ref.model_fingerprint
    assert new.logits.dtype == torch.float32 and torch.equal(new.logits, ref.logits)
    assert len(new.layers) == len(ref.layers)
    for a, b in zip(new.layers, ref.layers):
        for name in ("hidden", "positions", "k", "v"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and x.device == y.device and torch.equal(x, y), name
    assert torch.equal(new.kv_buffer(), ref.kv_buffer())
    for with_kv in (True, False):  # the same payload (its header's key order is the writer's own)
        a, b = new.to_bytes(with_kv), ref.to_bytes(with_kv)
        assert _header(a) == _header(b)
        x, y = load(a), load(b)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def _header(payload: bytes) -> dict:
    n = int.from_bytes(payload[:8], "little")
    return json.loads(payload[8:8 + n])


def _export_both(eng, chunks, suffix, mode, ratio, kv_on_device=False):
    logits, seq = _prefilled(eng, chunks, suffix, mode, ratio)
    try:
        ref = reference_export(eng.forward, seq, logits, eng.fingerprint, kv_on_device)
        new = export_sequence(eng.forward, seq, logits, eng.fingerprint, kv_on_device,
                              stage_export(eng.forward, seq, logits))
    finally:
        eng.release(seq)
    return new, ref


@pytest.mark.parametrize("mode, ratio", [("tessera", 0.0), ("tessera", 0.15), ("tessera", 1.0), ("full", 0.0),
                                         ("prefix", 0.0), ("blend_copy", 0.3), ("position_aware", 0.2)])
def test_export_equals_the_reference_cold_and_warm(engine, mode, ratio):
    chunks, suffix = random_request(40)
    for _ in range(2):  # chunks computed, then cached (prefix: its hits are entries of kind "prefix")
        new, ref = _export_both(engine, chunks, suffix, mode, ratio, kv_on_device=mode == "tessera")
        _assert_same(new, ref)
    assert engine.pool.num_free + sum(len(e.blocks) for e in engine.cache._entries.values()) == engine.pool.usable_blocks


@pytest.mark.parametrize("block_size, check_layer", [(8, 1), (16, 2), (64, 1)])
@pytest.mark.slow
def test_export_equals_the_reference_other_layouts(tiny_dir, block_size, check_layer):
    eng = Engine.load(tiny_dir, block_size=block_size, check_layer=check_layer)
    chunks, suffix = random_request(41, lengths=(20, 70, 17))
    for ratio in (0.0, 0.3):
        _assert_same(*_export_both(eng, chunks, suffix, "tessera", ratio))
    # one chunk twice: its blocks are shared by two entries at two starts
    _assert_same(*_export_both(eng, [chunks[0], chunks[1], chunks[0]], suffix, "tessera", 0.3))


@pytest.mark.slow
def test_export_reads_nothing_back_after_staging(engine):
    chunks, suffix = random_request(42)
    logits, seq = _prefilled(engine, chunks, suffix, "tessera", 0.15)
    try:
        ref = reference_export(engine.forward, seq, logits, engine.fingerprint)
        staging, export = Ops(), Ops()
        with staging:
            staged = stage_export(engine.forward, seq, logits)
        # what the export reads on the host is the staged copy: the pool's slot positions may change after
        private = torch.tensor(seq.private_blocks)
        engine.pool.slot_pos[private] = -1
        with export:
            new = export_sequence(engine.forward, seq, logits, engine.fingerprint, False, staged)
    finally:
        engine.release(seq)
    _assert_same(new, ref)
    assert not SYNCING & set(staging.names) and not SYNCING & set(export.names)
    copies = [n for n in export.names if n in ("index_select", "index", "copy_", "_to_copy", "cat")]
    # one gather for K and one for V per layer, and the index copy
    assert copies.count("index_select") == 2 * engine.cfg.num_layers and len(copies) <= 2 * engine.cfg.num_layers + 2


@pytest.mark.slow
def test_a_table_block_the_sequence_does_not_own_is_still_exported(engine):
    chunks, suffix = random_request(43)
    logits, seq = _prefilled(engine, chunks, suffix, "tessera", 0.3)
    try:
        ref = reference_export(engine.forward, seq, logits, engine.fingerprint)
        hidden_block = seq.private_blocks.pop()   # staged without its slot positions
        try:
            new = export_sequence(engine.forward, seq, logits, engine.fingerprint)
        finally:
            seq.private_blocks.append(hidden_block)
    finally:
        engine.release(seq)
    _assert_same(new, ref)


@pytest.mark.slow
def test_prefill_handoff_stages_before_the_first_token(engine):
    chunks, suffix = random_request(44)
    seen = []
    res, h = engine.prefill_handoff(chunks, suffix, mode="tessera", recompute_ratio=0.15,
                                    on_logits=lambda logits: seen.append(logits))
    assert len(seen) == 1 and torch.equal(seen[0], res.logits) and torch.equal(h.logits, res.logits)
    assert h.kv_buffer() is h.kv and h.layers[0].k.data_ptr() == h.kv.data_ptr()
    assert engine.pool.num_free + sum(len(e.blocks) for e in engine.cache._entries.values()) == engine.pool.usable_blocks


@pytest.mark.cuda
@pytest.mark.parametrize("kv_on_device", [True, False])
def test_cuda_export_equals_the_reference_and_never_syncs(tiny_dir, kv_on_device):
    eng = Engine.load(tiny_dir, device="cuda", dtype=torch.bfloat16)
    chunks, suffix = random_request(45)
    eng.prefill(chunks, suffix, mode="tessera", recompute_ratio=0.15)  # chunks resident
    logits, seq = _prefilled(eng, chunks, suffix, "tessera", 0.15)
    try:
        ref = reference_export(eng.forward, seq, logits, eng.fingerprint, kv_on_device)
        staged = stage_export(eng.forward, seq, logits)
        staged.ready.synchronize()   # what the first token's read does in a worker
        if kv_on_device:             # every device op after the first token is then asynchronous
            torch.cuda.set_sync_debug_mode("error")
        try:
            new = export_sequence(eng.forward, seq, logits, eng.fingerprint, kv_on_device, staged)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    finally:
        eng.release(seq)
    _assert_same(new, ref)
