"""Prefill -> decode hand-off carries private KV and chunk ids only; chunk KV streams in layer by layer."""

from __future__ import annotations

import threading

import pytest
import torch

from services.engine import Engine, Handoff
from services.engine.kv.loader import StreamedLayer, numbered

from tests.engine.conftest import random_request


def _decode(eng, handoff, n, fetch=None):
    seq = eng.import_handoff(handoff, fetch=fetch)
    toks = [int(handoff.logits.argmax())]
    try:
        while len(toks) < n:
            toks.append(int(eng.decode_step([seq], [toks[-1]])[0].argmax()))
    finally:
        eng.release(seq)
    return toks


@pytest.mark.parametrize("mode, ratio", [("tessera", 0.0), ("tessera", 0.15), ("tessera", 1.0), ("full", 0.0),
                                         ("prefix", 0.0), ("blend_copy", 0.3), ("position_aware", 0.2)])
@pytest.mark.slow
def test_decode_elsewhere_equals_generate(tiny_dir, mode, ratio):
    prefill, decode = Engine.load(tiny_dir), Engine.load(tiny_dir)
    chunks, suffix = random_request(30)
    ref = prefill.generate(chunks, suffix, max_new_tokens=6, mode=mode, recompute_ratio=ratio, stop_token_ids=[])
    _, h = prefill.prefill_handoff(chunks, suffix, mode=mode, recompute_ratio=ratio)
    assert _decode(decode, Handoff.from_bytes(h.to_bytes()), 6) == ref
    assert prefill.pool.num_free + sum(len(e.blocks) for e in prefill.cache._entries.values()) == prefill.pool.usable_blocks


@pytest.mark.slow
def test_kv_apart_from_the_payload_round_trips(tiny_dir):
    # the CUDA IPC transport ships the K/V as one flat buffer and the rest as bytes: same hand-off
    eng = Engine.load(tiny_dir)
    chunks, suffix = random_request(33)
    _, h = eng.prefill_handoff(chunks, suffix, mode="tessera", recompute_ratio=0.3, kv_on_device=True)
    back = Handoff.from_bytes(h.to_bytes(with_kv=False), h.kv_buffer())
    assert back.chunks == h.chunks and back.next_pos == h.next_pos and torch.equal(back.logits, h.logits)
    for a, b in zip(back.layers, h.layers):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and torch.equal(a.positions, b.positions)
        assert torch.equal(a.hidden, b.hidden)
    with pytest.raises(ValueError, match="no K/V for layer 0"):
        Handoff.from_bytes(h.to_bytes(with_kv=False))
    with pytest.raises(ValueError, match="its layers need"):
        Handoff.from_bytes(h.to_bytes(with_kv=False), h.kv_buffer()[:-1])
    with pytest.raises(ValueError, match="its header says"):
        Handoff.from_bytes(h.to_bytes(with_kv=False), h.kv_buffer().double())


def _tiny_handoff(layers: int = 5) -> Handoff:
    """A hand-off of ``layers`` layers of ragged lengths (an empty one among them), K/V views of one buffer."""
    from services.handoff.wire import ChunkRef, LayerView, layer_views

    counts = [3, 0, 7, 7, 2][:layers]
    kv = torch.randn(2 * sum(counts) * 2 * 4)
    views = layer_views(kv, counts, torch.Size((2, 4)))
    ls = tuple(LayerView(torch.arange(i + 1) * 3, torch.arange(n) + 100 * i, views[2 * i], views[2 * i + 1])
               for i, n in enumerate(counts))
    return Handoff("fp", (ChunkRef("c" * 64, 0, (1, 2, 3)),), ls, 40, torch.randn(11), kv=kv)


def _same_layers(a: Handoff, b: Handoff) -> None:
    assert len(a.layers) == len(b.layers) and a.chunks == b.chunks and torch.equal(a.logits, b.logits)
    for x, y in zip(a.layers, b.layers):
        for name in ("hidden", "positions", "k", "v"):
            assert torch.equal(getattr(x, name), getattr(y, name)), name


def test_a_payloads_layers_travel_packed_and_come_back_whole():
    """Every layer's hidden positions, positions and K/V travel as one tensor each (a few torch calls, not a few a
    layer); with the K/V inside or apart, the layers come back equal, the K/V views of one buffer."""
    from safetensors.torch import load

    h = _tiny_handoff()
    inside = h.to_bytes()
    assert set(load(inside)) == {"logits", "hidden", "positions", "kv"}
    for back in (Handoff.from_bytes(inside), Handoff.from_bytes(h.to_bytes(with_kv=False), h.kv_buffer())):
        _same_layers(back, h)
        assert all(lv.k.untyped_storage().data_ptr() == back.kv.untyped_storage().data_ptr() for lv in back.layers)


def test_a_payload_made_a_layer_at_a_time_is_still_read():
    """A payload of per-layer tensors (as hand-offs were made before the layers were packed) parses the same."""
    import json

    from safetensors.torch import save

    h = _tiny_handoff()
    tensors = {"logits": h.logits}
    for i, lv in enumerate(h.layers):
        tensors.update({f"{i}.{n}": getattr(lv, n).clone() for n in ("hidden", "positions", "k", "v")})
    meta = {"fingerprint": "fp", "next_pos": "40", "layers": str(len(h.layers)), "kv": json.dumps([[2, 4], "float32"]),
            "chunks": json.dumps([[c.chunk_id, c.start, list(c.tokens)] for c in h.chunks])}
    _same_layers(Handoff.from_bytes(save(tensors, metadata=meta)), h)


@pytest.mark.parametrize("damage, match", [
    (lambda m, t: m.update(hidden="[1, 2]"), "hidden lengths are not 5 counts"),
    (lambda m, t: m.update(positions='[3, 0, 7, 7, "2"]'), "positions lengths are not 5 counts"),
    (lambda m, t: m.update(positions="[3, 0, 7, 7, -2]"), "positions lengths are not 5 counts"),
    (lambda m, t: m.pop("hidden"), "hidden lengths are not 5 counts"),
    (lambda m, t: t.update(positions=t["positions"][:-1]), "positions holds 18 values, its layers' lengths sum to 19"),
    (lambda m, t: t.update(hidden=t["hidden"].reshape(3, 5)), "hidden holds 15 values"),
])
def test_a_packed_payload_whose_lengths_do_not_fit_is_refused(damage, match):
    import json

    from safetensors.torch import load, save

    data = _tiny_handoff().to_bytes()
    tensors = load(data)
    meta = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    damage(meta, tensors)
    with pytest.raises(ValueError, match=match):
        Handoff.from_bytes(save(tensors, metadata=meta))


@pytest.mark.slow
def test_tessera_handoff_ships_only_private_kv(tiny_dir):
    eng = Engine.load(tiny_dir)
    chunks, suffix = random_request(31, lengths=(40, 40, 40))
    _, h0 = eng.prefill_handoff(chunks, suffix, mode="tessera", recompute_ratio=0.0)
    _, hf = eng.prefill_handoff(chunks, suffix, mode="full")
    assert [c.chunk_id for c in h0.chunks] == [eng.chunk_id(c) for c in chunks]
    assert [c.start for c in h0.chunks] == [0, 40, 80]
    assert all(lv.positions.tolist() == list(range(120, 127)) for lv in h0.layers)
    assert hf.chunks == () and hf.private_bytes > 15 * h0.private_bytes
    _, h = eng.prefill_handoff(chunks, suffix, mode="tessera", recompute_ratio=0.15)
    recomputed = h.layers[1].hidden
    assert recomputed.numel() == 18 and set(recomputed.tolist()) <= set(h.layers[1].positions.tolist())
    assert h.layers[0].hidden.numel() == 0  # layer 0 reads the cache as is


@pytest.mark.slow
def test_decode_worker_without_the_chunks_fetches_or_recomputes(tiny_dir):
    prefill, decode, other = Engine.load(tiny_dir), Engine.load(tiny_dir), Engine.load(tiny_dir)
    chunks, suffix = random_request(32)
    ref = prefill.generate(chunks, suffix, max_new_tokens=5, stop_token_ids=[])
    _, h = prefill.prefill_handoff(chunks, suffix)
    store = {prefill.chunk_id(c): prefill.export_chunk(prefill.chunk_id(c)) for c in chunks[:2]}
    assert _decode(decode, h, 5, fetch=lambda cid: numbered(store[cid]) if cid in store else None) == ref  # two fetched, one computed
    assert _decode(other, h, 5) == ref                                      # all three recomputed


def test_store_stream_overlaps_compute_and_equals_a_local_hit(tiny_dir):
    source = Engine.load(tiny_dir)
    chunks, suffix = random_request(33, lengths=(30, 30, 30))
    local = source.prefill(chunks, suffix, mode="tessera", recompute_ratio=0.15)
    store = {source.chunk_id(c): source.export_chunk(source.chunk_id(c)) for c in chunks}
    # a store that sends layer i only once the pass has asked for layer i - 1 (a slow wire)
    gates = {cid: [threading.Event() for _ in range(4)] for cid in store}
    eng = Engine.load(tiny_dir)
    orig_wait = eng.forward.wait_layer

    def wait(layer):
        for g in gates.values():
            if layer + 1 < 4:
                g[layer + 1].set()
        orig_wait(layer)

    eng.forward.wait_layer = wait

    def fetch(cid):
        def stream():
            for i, (k, v) in enumerate(store[cid]):
                if i:
                    assert gates[cid][i].wait(10), "the pass never asked for the previous layer"
                yield StreamedLayer(i, k, v)
        return stream()

    res, _ = eng.prefill_handoff(chunks, suffix, mode="tessera", recompute_ratio=0.15, fetch=fetch)
    assert res.stats.store_hits == 3 and res.stats.chunk_misses == 0 and res.stats.load_failures == 0
    assert res.stats.loaded_bytes == sum(k.numel() * 4 * 2 for layers in store.values() for k, _ in layers)
    torch.testing.assert_close(res.logits, local.logits)


def test_a_broken_stream_is_recomputed_and_never_cached_half_done(tiny_dir):
    source = Engine.load(tiny_dir)
    chunks, suffix = random_request(34)
    ref = source.prefill(chunks, suffix, mode="tessera", recompute_ratio=0.15).logits
    store = {source.chunk_id(c): source.export_chunk(source.chunk_id(c)) for c in chunks}

    def broken(cid):
        def stream():
            for i, (k, v) in enumerate(store[cid]):
                if i == 2:
                    raise ConnectionError("store shard went away")
                yield StreamedLayer(i, k, v)
        return stream()

    eng = Engine.load(tiny_dir)
    res, _ = eng.prefill_handoff(chunks, suffix, mode="tessera", recompute_ratio=0.15, fetch=broken)
    assert res.stats.load_failures == 3
    torch.testing.assert_close(res.logits, ref)
    again = eng.prefill(chunks, suffix, mode="tessera", recompute_ratio=0.15)
    assert again.stats.chunk_hits == 3
    torch.testing.assert_close(again.logits, ref)


def test_wrong_shapes_from_the_store_fall_back_to_compute(tiny_dir):
    eng = Engine.load(tiny_dir)
    chunks, suffix = random_request(35)
    ref = Engine.load(tiny_dir).prefill(chunks, suffix, mode="tessera").logits
    bad = lambda cid: iter([(i, torch.randn(3, 2, 32), torch.randn(3, 2, 32)) for i in range(4)])  # noqa: E731
    res = eng.prefill(chunks, suffix, mode="tessera")  # warm nothing: a fresh engine below
    eng2 = Engine.load(tiny_dir)
    r2, _ = eng2.prefill_handoff(chunks, suffix, mode="tessera", fetch=bad)
    assert r2.stats.load_failures == 3
    torch.testing.assert_close(r2.logits, ref)
    torch.testing.assert_close(res.logits, ref)


def test_handoff_from_another_model_is_refused(tiny_dirs):
    a, b = Engine.load(tiny_dirs["llama"]), Engine.load(tiny_dirs["mistral"])
    _, h = a.prefill_handoff(*random_request(36))
    with pytest.raises(ValueError, match="hand-off was made by model"):
        b.import_handoff(h)
    with pytest.raises(ValueError, match="not a Tessera hand-off"):
        Handoff.from_bytes(__import__("safetensors.torch").torch.save({"x": torch.zeros(1)}))
