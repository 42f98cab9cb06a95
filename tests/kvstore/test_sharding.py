"""Consistent hashing over store shards."""

from __future__ import annotations

from services.kvstore import HashRing, ShardedKVStoreClient

from .helpers import MiB, assert_roundtrip, make_layers

KEYS = [f"{i:064x}" for i in range(3000)]


def test_adding_a_shard_moves_only_keys_to_the_new_shard():
    ring = HashRing(["a:1", "b:1", "c:1"])
    before = {k: ring.node_for(k) for k in KEYS}
    ring.add("d:1")
    after = {k: ring.node_for(k) for k in KEYS}
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == "d:1" for k in moved)
    assert 0.1 < len(moved) / len(KEYS) < 0.4          # about 1/4 with 128 points per shard
    ring.remove("d:1")
    assert {k: ring.node_for(k) for k in KEYS} == before


def test_load_is_spread_over_shards():
    ring = HashRing([f"10.0.0.{i}:7000" for i in range(4)])
    counts = {}
    for k in KEYS:
        counts[ring.node_for(k)] = counts.get(ring.node_for(k), 0) + 1
    assert len(counts) == 4 and max(counts.values()) < 2 * min(counts.values())


def test_sharded_client_routes_each_chunk_to_its_shard(start_store):
    shards = [start_store(dram_bytes=16 * MiB) for _ in range(3)]
    addresses = [srv.address for srv, _ in shards]
    chunks = {f"{i:08x}": make_layers(n_layers=2, tokens=16, heads=2, dim=32, seed=i) for i in range(12)}
    with ShardedKVStoreClient(addresses, timeout=30) as sharded:
        for cid, layers in chunks.items():
            sharded.put(cid, layers)
        for cid, layers in chunks.items():
            assert_roundtrip(sharded, cid, layers)
            owner = sharded.shard_for(cid)
            for srv, client in shards:
                assert client.lookup([cid])[0].found == (srv.address == owner)
        assert all(loc.found for loc in sharded.lookup(list(chunks)))
        assert len({sharded.shard_for(c) for c in chunks}) > 1
        stats = sharded.stats()
        assert sum(s.tiers[0].chunks for s in stats.values()) == len(chunks)
        victim = next(iter(chunks))
        assert sharded.delete(victim) and not sharded.lookup([victim])[0].found
