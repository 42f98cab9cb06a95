"""Tiers through the service: round trips from each tier, budgets, promotion, write modes."""

from __future__ import annotations

import os

import grpc
import pytest
import torch

from services.kvstore.chunk import TIER_OF_PB

from .helpers import MiB, assert_roundtrip, chunk_nbytes, make_layers, tiers_of

# 4 layers x 2 x [64, 8, 128] bf16 = 1 MiB per chunk
SHAPE = dict(n_layers=4, tokens=64, heads=8, dim=128)


def resident(client) -> dict[str, tuple[int, int]]:
    return {TIER_OF_PB[t.tier]: (t.resident_bytes, t.budget_bytes) for t in client.stats().tiers}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_roundtrip_is_byte_exact_from_dram(start_store, dtype):
    _, c = start_store()
    layers = make_layers(n_layers=3, tokens=37, heads=3, dim=64, dtype=dtype, seed=1)   # odd shapes
    layers[1] = (layers[1][0], torch.randn(11, 5, 64).to(dtype))                         # V shaped unlike K
    put = c.put("c-" + str(dtype).split(".")[1], layers, model_fingerprint="llama-test")
    assert put.tiers == ("dram",) and put.nbytes == chunk_nbytes(layers)
    assert_roundtrip(c, put.chunk_id, layers)
    assert_roundtrip(c, put.chunk_id, layers, (1, 3))
    assert_roundtrip(c, put.chunk_id, layers, (2, 3))


def test_layers_received_without_a_copy_are_the_callers_own(start_store):
    """Layers sent whole are yielded as tensors over the received message, no copy: writing into
    them changes neither the other tensor of the layer nor what the store serves next."""
    _, c = start_store()
    layers = make_layers(n_layers=2, tokens=64, heads=8, dim=128, seed=3)
    c.put("x", layers)
    first = list(c.get("x"))
    for i, k, v in first:
        assert k.data_ptr() % 16 == 0 and v.data_ptr() == k.data_ptr() + k.numel() * k.element_size()
        k.fill_(1.0)
        assert torch.equal(v, layers[i][1]) and torch.equal(k, torch.ones_like(k))
    assert_roundtrip(c, "x", layers)


def test_layers_span_several_frames(start_store):
    _, c = start_store(dram_bytes=10 * MiB, rocksdb_dir="tmp", rocksdb_bytes=32 * MiB)
    layers = make_layers(n_layers=2, tokens=600, heads=8, dim=128, dtype=torch.float32, seed=2)  # 2.3 MiB per K
    c.put("big", layers)
    assert_roundtrip(c, "big", layers)
    c.put("evictor", make_layers(n_layers=2, tokens=600, heads=8, dim=128, dtype=torch.float32, seed=3))
    assert tiers_of(c, "big") == ("rocksdb",)     # written to the layer file in its pieces, read back whole
    assert_roundtrip(c, "big", layers)


@pytest.mark.slow
def test_budgets_hold_and_lru_evicts_down_the_tiers(start_store, s3_config):
    _, c = start_store(dram_bytes=3 * MiB, rocksdb_dir="tmp", rocksdb_bytes=5 * MiB, s3=s3_config)
    chunks = {f"k{i}": make_layers(seed=10 + i, **SHAPE) for i in range(8)}
    for cid, layers in chunks.items():
        assert c.put(cid, layers).tiers == ("dram", "rocksdb", "s3")      # write-through
        for used, budget in resident(c).values():
            assert used <= budget
    assert [tiers_of(c, f"k{i}") for i in (0, 2, 3, 5, 7)] == [
        ("s3",), ("s3",), ("rocksdb", "s3"), ("dram", "rocksdb", "s3"), ("dram", "rocksdb", "s3")]
    assert {t.tier: t.evictions for t in c.stats().tiers} == {1: 5, 2: 3, 3: 0}
    assert_roundtrip(c, "k0", chunks["k0"])     # from S3, then promoted
    assert tiers_of(c, "k0") == ("dram", "rocksdb", "s3")
    for used, budget in resident(c).values():
        assert used <= budget
    for cid, layers in chunks.items():         # every chunk is still served, whatever its tier
        assert_roundtrip(c, cid, layers)


def test_a_hit_below_is_promoted_and_reported_by_tier(start_store):
    _, c = start_store(dram_bytes=2 * MiB, rocksdb_dir="tmp", rocksdb_bytes=8 * MiB)
    a, b, d = (make_layers(seed=s, **SHAPE) for s in (1, 2, 3))
    c.put("a", a), c.put("b", b), c.put("d", d)
    assert tiers_of(c, "a") == ("rocksdb",)
    assert_roundtrip(c, "a", a)
    assert tiers_of(c, "a") == ("dram", "rocksdb")       # promoted
    assert tiers_of(c, "b") == ("rocksdb",)              # LRU victim of the promotion
    stats = {t.tier: t for t in c.stats().tiers}
    assert stats[2].hits == 1 and stats[1].misses == 1


def test_partial_read_from_below_is_served_but_not_promoted(start_store):
    _, c = start_store(dram_bytes=1 * MiB, rocksdb_dir="tmp", rocksdb_bytes=8 * MiB)
    a, b = make_layers(seed=1, **SHAPE), make_layers(seed=2, **SHAPE)
    c.put("a", a), c.put("b", b)
    assert_roundtrip(c, "a", a, (1, 3))
    assert tiers_of(c, "a") == ("rocksdb",)


def test_chunk_over_a_tier_budget_is_refused_and_harms_nothing(start_store):
    _, c = start_store(dram_bytes=2 * MiB, rocksdb_dir="tmp", rocksdb_bytes=16 * MiB)
    small = make_layers(seed=1, **SHAPE)
    c.put("small", small)
    with pytest.raises(grpc.RpcError) as err:
        c.put("huge", make_layers(n_layers=12, tokens=64, heads=8, dim=128, seed=2))   # 3 MiB > DRAM budget
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not c.lookup(["huge"])[0].found
    assert_roundtrip(c, "small", small)


def test_write_behind_acks_from_dram_and_loses_nothing_on_eviction(start_store, tmp_path):
    srv, c = start_store(dram_bytes=1 * MiB, rocksdb_dir="tmp", rocksdb_bytes=16 * MiB, write_mode="behind")
    chunks = {f"w{i}": make_layers(seed=20 + i, **SHAPE) for i in range(4)}
    for cid, layers in chunks.items():
        assert c.put(cid, layers).tiers == ("dram",)
    # Each put evicted the previous chunk from DRAM; a chunk not yet written down is copied down
    # first, so every chunk is served whatever the flusher had reached.
    for cid, layers in chunks.items():
        assert_roundtrip(c, cid, layers)
    srv.stop()                                           # drains the write-behind queue
    from services.kvstore import BackgroundServer, KVStoreClient, StoreConfig

    with BackgroundServer(StoreConfig(dram_bytes=MiB, rocksdb_dir=str(tmp_path / "rocksdb"))) as again:
        with KVStoreClient(again.address) as c2:
            for cid, layers in chunks.items():
                assert "rocksdb" in tiers_of(c2, cid)
                assert_roundtrip(c2, cid, layers)


def test_s3fifo_policy_serves_and_keeps_budget(start_store):
    _, c = start_store(dram_bytes=3 * MiB, rocksdb_dir="tmp", rocksdb_bytes=64 * MiB, policy="s3fifo")
    hot = make_layers(seed=99, **SHAPE)
    c.put("hot", hot)
    for i in range(6):
        assert_roundtrip(c, "hot", hot)
        c.put(f"once{i}", make_layers(seed=i, **SHAPE))
        assert resident(c)["dram"][0] <= 3 * MiB
    assert "dram" in tiers_of(c, "hot")
    assert c.stats().policy == "s3fifo"


def test_restart_on_the_same_rocksdb_dir_serves_what_was_stored(tmp_path):
    from services.kvstore import BackgroundServer, KVStoreClient, StoreConfig

    cfg = dict(dram_bytes=4 * MiB, rocksdb_dir=str(tmp_path / "db"), rocksdb_bytes=8 * MiB)
    layers = make_layers(seed=5, **SHAPE)
    with BackgroundServer(StoreConfig(**cfg)) as srv, KVStoreClient(srv.address) as c:
        c.put("persist", layers)
    with BackgroundServer(StoreConfig(**{**cfg, "rocksdb_bytes": 8 * MiB})) as srv, KVStoreClient(srv.address) as c:
        assert tiers_of(c, "persist") == ("rocksdb",)
        assert_roundtrip(c, "persist", layers)
        assert c.delete("persist") and not c.lookup(["persist"])[0].found


def test_a_tier_failing_mid_put_leaves_the_chunk_in_no_tier(start_store, s3_config):
    srv, c = start_store(dram_bytes=8 * MiB, rocksdb_dir="tmp", rocksdb_bytes=8 * MiB, s3=s3_config)
    rocks = next(s for s in srv.server.store.slots if s.name == "rocksdb").storage
    real_write = rocks.write

    def failing_write(meta, layers):
        raise OSError("disk full")
    rocks.write = failing_write                  # S3 (written first) succeeds, RocksDB fails
    with pytest.raises(grpc.RpcError):
        c.put("doomed", make_layers(seed=1, **SHAPE))
    rocks.write = real_write
    assert not c.lookup(["doomed"])[0].found
    layers = make_layers(seed=2, **SHAPE)
    c.put("fine", layers)
    assert_roundtrip(c, "fine", layers)


def test_reopening_the_disk_tier_drops_what_no_record_commits(tmp_path):
    """A layer file no metadata record names (a write cut short) is removed when the tier opens,
    and a record whose file is gone is dropped; complete chunks stay."""
    from services.kvstore.chunk import ChunkMeta, checksum
    from services.kvstore.tiers import RocksDBTier

    def meta_of(chunk_id, layers):          # K and V of layer i: the bytes ``layers[i]`` each, as float32
        shapes = tuple((len(b) // 4,) for b in layers)
        return ChunkMeta(chunk_id, "", "float32", shapes, shapes, tuple(checksum(b + b) for b in layers))

    def as_kv(layers):          # each layer's K||V: K and V the same bytes here
        return tuple(b + b for b in layers)

    kept, lost = [b"\1" * 4096, b"\2" * 8192], [b"\3" * 4096]
    tier = RocksDBTier(str(tmp_path / "db"))
    tier.write(meta_of("kept", kept), as_kv(kept))
    tier.write(meta_of("lost", lost), as_kv(lost))
    os.unlink(tier.layer_file("lost"))
    orphan = os.path.join(tier.files, ".cut.short.0123")
    open(orphan, "wb").write(b"partial")
    tier.close()

    tier = RocksDBTier(str(tmp_path / "db"))
    try:
        assert tier.scan() == [("kept", 2 * (4096 + 8192))]
        assert not os.path.exists(orphan) and tier.open("lost") is None
        reader = tier.open("kept")
        for i, layer in enumerate(kept):
            data = reader.layer(i)
            reader.meta.verify_layer(i, data)
            assert bytes(data.payload) == layer + layer
        reader.close()
        assert sorted(os.listdir(tier.files)) == [os.path.basename(tier.layer_file("kept"))]
    finally:
        tier.close()
