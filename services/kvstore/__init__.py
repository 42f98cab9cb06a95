"""Chunk KV store: DRAM -> RocksDB -> S3 tiers, streamed layer by layer over gRPC.

Clients: ``KVStoreClient`` (one shard), ``ShardedKVStoreClient`` (consistent hashing over shards).
Servers: ``create_server`` (async factory, returns (server, port)), ``serve`` (blocking),
``BackgroundServer`` (in a thread). Heavy imports (torch, grpc) happen on first attribute use.
"""

from __future__ import annotations

_EXPORTS = {
    "KVStoreClient": "services.kvstore.client",
    "ChunkLocation": "services.kvstore.client",
    "PutResult": "services.kvstore.client",
    "ChunkCorruptError": "services.kvstore.client",
    "ShardedKVStoreClient": "services.kvstore.sharding",
    "HashRing": "services.kvstore.sharding",
    "StoreConfig": "services.kvstore.config",
    "S3Config": "services.kvstore.config",
    "create_server": "services.kvstore.server",
    "serve": "services.kvstore.server",
    "BackgroundServer": "services.kvstore.server",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'services.kvstore' has no attribute {name!r}")
