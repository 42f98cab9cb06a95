"""Corrupt or truncated entries are never served: dropped, served from below, or DATA_LOSS."""

from __future__ import annotations

import os

import grpc
import torch
import pytest

from services.kvstore import wire
from services.kvstore.chunk import checksum, layer_bytes
from services.kvstore.store import TierSlot
from services.kvstore.tiers import StoredChunk, _meta_key, layer_spans
from services.rpc import kvstore_pb2 as pb

from .helpers import MiB, assert_roundtrip, make_layers, tiers_of

SHAPE = dict(n_layers=8, tokens=32, heads=8, dim=128)   # 1 MiB, more layers than the read-ahead depth


def flip(data: bytes, at: int = 1000) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1:]


def slot(srv, name) -> TierSlot:
    return next(s for s in srv.server.store.slots if s.name == name)


def corrupt_dram_layer(srv, chunk_id, layer):
    async def damage():
        dram = slot(srv, "dram").storage
        stored = dram.get(chunk_id)
        layers = list(stored.layers)
        layers[layer] = flip(layer_bytes(layers[layer]))
        dram._chunks[chunk_id] = StoredChunk(stored.meta, tuple(layers))
    srv.run(damage())


def rewrite_layer(db, chunk_id, layer, damage) -> bytes:
    """Apply ``damage`` (bytes -> bytes) to a layer in the RocksDB tier's layer file; a shorter
    result cuts the file there. Returns the layer's stored bytes as they were."""
    path = db.layer_file(chunk_id)
    data = open(path, "rb").read()
    offset, length = layer_spans(db.open(chunk_id).meta)[layer]
    before = data[offset:offset + length]
    after = damage(before)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(after)
        if len(after) < length:
            f.truncate(offset + len(after))
    return before


def corrupt_counts(client) -> dict[int, int]:
    return {t.tier: t.corrupt_entries for t in client.stats().tiers}


def test_corrupt_dram_layer_is_dropped_and_served_from_rocksdb(start_store):
    srv, c = start_store(dram_bytes=8 * MiB, rocksdb_dir="tmp", rocksdb_bytes=8 * MiB)
    layers = make_layers(seed=1, **SHAPE)
    c.put("x", layers)
    corrupt_dram_layer(srv, "x", 2)           # layers 0-1 stream from DRAM, 2-3 from RocksDB
    assert_roundtrip(c, "x", layers)
    assert corrupt_counts(c) == {1: 1, 2: 0}
    assert tiers_of(c, "x") == ("dram", "rocksdb")   # dropped from DRAM, then promoted back
    assert_roundtrip(c, "x", layers)
    assert corrupt_counts(c) == {1: 1, 2: 0}


def test_damaged_envelope_of_a_stored_message_is_caught(start_store):
    """A DRAM layer is kept as the message a get sends as is; a bad byte outside its K||V bytes (here
    the layer index) is corruption too, though the payload's checksum still matches."""
    srv, c = start_store(dram_bytes=8 * MiB, rocksdb_dir="tmp", rocksdb_bytes=8 * MiB)
    layers = make_layers(seed=1, **SHAPE)
    c.put("x", layers)

    async def damage():
        dram = slot(srv, "dram").storage
        stored = dram.get("x")
        framed = stored.layers[3]
        assert isinstance(framed, wire.FramedLayer)
        at = framed.message.index(b"\x08\x03", 0, framed.start) + 1           # field 1 (layer index) = 3
        bad = wire.FramedLayer(framed.message[:at] + b"\x04" + framed.message[at + 1:], framed.start, framed.nbytes)
        assert layer_bytes(bad) == layer_bytes(framed)
        dram._chunks["x"] = StoredChunk(stored.meta, stored.layers[:3] + (bad,) + stored.layers[4:])
    srv.run(damage())
    assert_roundtrip(c, "x", layers)
    assert corrupt_counts(c) == {1: 1, 2: 0}


def test_corrupt_only_copy_is_data_loss_and_dropped(start_store):
    srv, c = start_store(dram_bytes=8 * MiB)
    layers, other = make_layers(seed=1, **SHAPE), make_layers(seed=2, **SHAPE)
    c.put("x", layers), c.put("y", other)
    corrupt_dram_layer(srv, "x", 0)
    with pytest.raises(grpc.RpcError) as err:
        list(c.get("x"))
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    assert not c.lookup(["x"])[0].found
    with pytest.raises(grpc.RpcError) as err:
        list(c.get("x"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert_roundtrip(c, "y", other)


@pytest.mark.parametrize("damage", ["flipped", "truncated", "meta"])
def test_bad_rocksdb_entry_is_data_loss_without_a_lower_tier(start_store, damage):
    srv, c = start_store(dram_bytes=1 * MiB, rocksdb_dir="tmp", rocksdb_bytes=8 * MiB)
    layers = make_layers(seed=3, **SHAPE)
    c.put("x", layers), c.put("evictor", make_layers(seed=4, **SHAPE))
    assert tiers_of(c, "x") == ("rocksdb",)
    db = slot(srv, "rocksdb").storage
    if damage == "meta":
        raw = db._db.get(_meta_key("x"))
        db.put_raw(_meta_key("x"), flip(raw, at=len(raw) - 3))
    else:
        rewrite_layer(db, "x", 1, flip if damage == "flipped" else lambda raw: raw[: len(raw) // 2])
    with pytest.raises(grpc.RpcError) as err:
        list(c.get("x"))
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    assert corrupt_counts(c)[2] == 1
    assert not c.lookup(["x"])[0].found and db._db.get(_meta_key("x")) is None


@pytest.mark.slow
def test_bad_rocksdb_layer_is_served_from_s3(start_store, s3_config):
    srv, c = start_store(dram_bytes=1 * MiB, rocksdb_dir="tmp", rocksdb_bytes=8 * MiB, s3=s3_config)
    layers = make_layers(seed=3, **SHAPE)
    c.put("x", layers), c.put("evictor", make_layers(seed=4, **SHAPE))
    db = slot(srv, "rocksdb").storage
    rewrite_layer(db, "x", 3, lambda raw: raw[:100])    # the file cut inside layer 3
    assert_roundtrip(c, "x", layers)
    assert corrupt_counts(c) == {1: 0, 2: 1, 3: 0}
    assert tiers_of(c, "x") == ("dram", "rocksdb", "s3")   # bad copy dropped, good one promoted back
    k, v = (t.view(torch.uint8).numpy().tobytes() for t in layers[3])
    stored = rewrite_layer(db, "x", 3, lambda raw: raw)   # the promoted copy, as the file holds it
    frame = pb.GetResponse.FromString(stored).frame        # the message that carries layer 3 whole
    assert (frame.layer_index, frame.data, frame.end_of_layer, frame.checksum) == (3, k + v, True, checksum(k + v))


def test_corrupt_s3_object_is_data_loss(start_store, s3_config):
    srv, c = start_store(dram_bytes=8 * MiB, s3=s3_config)
    layers = make_layers(seed=3, **SHAPE)
    c.put("x", layers)
    s3 = slot(srv, "s3").storage
    s3.put_raw("x", flip(s3.get_raw("x"), at=200_000))
    srv.run(_forget_dram(srv, "x"))
    with pytest.raises(grpc.RpcError) as err:
        list(c.get("x"))
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    assert not c.lookup(["x"])[0].found                # the bad object was deleted


async def _forget_dram(srv, chunk_id):
    s = slot(srv, "dram")
    s.residency.discard(chunk_id)
    s.storage.remove(chunk_id)


def _read_with_interference(srv, chunk_id, interfere):
    """Read layer 0 through the store, run ``interfere`` (a coroutine function), read the rest."""
    async def go():
        store = srv.server.store
        session = await store.open_read(chunk_id)
        out = [layer_bytes(await session.layer(0, session.meta.num_layers))]   # read-aheads in flight
        await interfere(store)
        try:
            for i in range(1, session.meta.num_layers):
                out.append(layer_bytes(await session.layer(i, session.meta.num_layers)))
        finally:
            session.abort()
        return out
    return srv.run(go())


def _expected(layers):
    return [k.view(torch.uint8).numpy().tobytes() + v.view(torch.uint8).numpy().tobytes() for k, v in layers]


def test_removal_during_a_rocksdb_read_finishes_the_version_opened(start_store):
    srv, c = start_store(dram_bytes=1 * MiB, rocksdb_dir="tmp", rocksdb_bytes=8 * MiB)
    layers = make_layers(seed=3, **SHAPE)
    c.put("x", layers), c.put("evictor", make_layers(seed=4, **SHAPE))
    path = slot(srv, "rocksdb").storage.layer_file("x")

    async def delete(store):
        await store.delete("x")
    assert _read_with_interference(srv, "x", delete) == _expected(layers)   # the open file keeps its bytes
    assert corrupt_counts(c) == {1: 0, 2: 0}
    assert not c.lookup(["x"])[0].found and not os.path.exists(path)


def test_a_copy_lost_during_a_read_is_aborted_not_called_corruption(start_store):
    from services.kvstore.store import ChunkVanished

    srv, c = start_store(dram_bytes=1 * MiB, rocksdb_dir="tmp", rocksdb_bytes=8 * MiB)
    c.put("x", make_layers(seed=3, **SHAPE)), c.put("evictor", make_layers(seed=4, **SHAPE))
    path = slot(srv, "rocksdb").storage.layer_file("x")

    async def lose(store):
        os.truncate(path, 0)            # the bytes under the open reader gone (e.g. the disk), then the chunk deleted
        await store.delete("x")
    with pytest.raises(ChunkVanished):
        _read_with_interference(srv, "x", lose)
    assert corrupt_counts(c) == {1: 0, 2: 0}


def test_eviction_during_a_rocksdb_read_continues_from_s3(start_store, s3_config):
    srv, c = start_store(dram_bytes=1 * MiB, rocksdb_dir="tmp", rocksdb_bytes=8 * MiB, s3=s3_config)
    layers = make_layers(seed=3, **SHAPE)
    c.put("x", layers), c.put("evictor", make_layers(seed=4, **SHAPE))

    async def evict_from_rocksdb(store):
        rocks = slot(srv, "rocksdb")
        async with store._lock:
            rocks.residency.discard("x")
            await store._evict(rocks, "x")
    assert _read_with_interference(srv, "x", evict_from_rocksdb) == _expected(layers)
    assert corrupt_counts(c) == {1: 0, 2: 0, 3: 0}


def test_replacement_during_a_read_never_mixes_versions(start_store):
    srv, c = start_store(dram_bytes=1 * MiB, rocksdb_dir="tmp", rocksdb_bytes=8 * MiB)
    old, new = make_layers(seed=3, **SHAPE), make_layers(seed=5, **SHAPE)
    c.put("x", old), c.put("evictor", make_layers(seed=4, **SHAPE))

    async def replace(store):
        reader = slot(srv, "rocksdb").storage.open("x")
        meta = reader.meta.with_checksums([checksum(b) for b in _expected(new)])
        await store.put(meta, tuple(_expected(new)))
    assert _read_with_interference(srv, "x", replace) == _expected(old)    # the version opened, whole
    assert corrupt_counts(c) == {1: 0, 2: 0}
    assert_roundtrip(c, "x", new)
