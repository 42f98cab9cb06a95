"""Configuration of one KV store process, checked once at construction."""

from __future__ import annotations

import os
from dataclasses import dataclass

from services.checks import check_bool, check_instance, check_int, check_path, check_str
from services.kvstore.arena import PAGE, SEGMENT_BYTES

POLICIES = ("lru", "s3fifo")
WRITE_MODES = ("through", "behind")
MiB = 1 << 20


@dataclass(slots=True)
class S3Config:
    """Object-storage tier. Credentials left as None come from the environment (boto3's chain)."""

    endpoint_url: str | None
    bucket: str
    prefix: str = "chunks/"
    region: str = "us-east-1"
    access_key_id: str | None = None
    secret_access_key: str | None = None
    create_bucket: bool = True

    def __post_init__(self) -> None:
        check_str("endpoint_url", self.endpoint_url, optional=True)
        check_str("bucket", self.bucket)
        check_str("prefix", self.prefix)
        check_str("region", self.region)
        for name in ("access_key_id", "secret_access_key"):     # credentials: their type named, never the value
            if not isinstance(getattr(self, name), (str, type(None))):
                raise ValueError(f"{name} must be None or a str, got {type(getattr(self, name)).__name__}")
        check_bool("create_bucket", self.create_bucket)
        if not self.bucket:
            raise ValueError("S3 bucket name must not be empty")
        if self.endpoint_url is not None and not self.endpoint_url.startswith(("http://", "https://")):
            raise ValueError(f"S3 endpoint must be an http(s) URL, got {self.endpoint_url!r}")


@dataclass(slots=True)
class StoreConfig:
    """One store shard: DRAM budget, optional RocksDB directory and budget, optional S3 tier.

    Budgets count the K and V bytes of resident chunks (per-chunk metadata is a few hundred bytes
    and is not counted). ``write_mode="through"`` writes every put to every tier before it is
    acknowledged (an acknowledged chunk survives a SIGKILL when RocksDB is configured);
    ``"behind"`` acknowledges once the chunk is in DRAM and copies it down in the background.
    ``dram_dir``: keep the DRAM tier as files in this directory of a memory file system (/dev/shm), which
    workers on the store's host read themselves (``tiers.ShmDramTier``); None: in the store's own memory. There,
    ``dram_segment_bytes``: the size of the arena's segment files, which such workers map and register with CUDA
    once each (``arena.Arena``); 0: each chunk a file of its own (pinned per read: slower onto a GPU).
    """

    dram_bytes: int = 1 << 30
    rocksdb_dir: str | None = None
    rocksdb_bytes: int = 16 << 30
    s3: S3Config | None = None
    policy: str = "lru"
    write_mode: str = "through"
    frame_bytes: int = 3 * MiB   # largest payload of one get message; a layer up to this travels whole
    rocksdb_sync: bool = False   # fsync the WAL on every put: only needed against power loss
    max_chunk_bytes: int = 4 << 30
    dram_dir: str | None = None
    dram_segment_bytes: int = SEGMENT_BYTES
    # run a NIXL agent over the arena: callers on other hosts that ask (GetRequest.nixl) read a chunk's layers from
    # the store's memory over NIXL (UCX) instead of the gRPC stream (services/kvstore/nixl_export.py)
    nixl: bool = False

    def __post_init__(self) -> None:
        check_int("dram_bytes", self.dram_bytes, 1, rule="positive")
        check_path("rocksdb_dir", self.rocksdb_dir, optional=True)
        check_int("rocksdb_bytes", self.rocksdb_bytes, 1, rule="positive")
        if self.rocksdb_dir is not None:
            parent = os.path.dirname(os.path.abspath(self.rocksdb_dir))
            if not os.path.isdir(parent):
                raise FileNotFoundError(f"parent directory of --rocksdb-dir does not exist: {parent}")
        check_instance("s3", self.s3, S3Config, optional=True)
        check_str("policy", self.policy, choices=POLICIES)
        check_str("write_mode", self.write_mode, choices=WRITE_MODES)
        # gRPC's default message limit is 4 MiB; frames leave room for the envelope.
        check_int("frame_bytes", self.frame_bytes, 4096, 3 * MiB, rule="within [4096, 3 MiB]")
        check_bool("rocksdb_sync", self.rocksdb_sync)
        check_int("max_chunk_bytes", self.max_chunk_bytes, 1, rule="positive")
        check_path("dram_dir", self.dram_dir, optional=True)
        check_int("dram_segment_bytes", self.dram_segment_bytes, 0)
        check_bool("nixl", self.nixl)
        if 0 < self.dram_segment_bytes < 2 * PAGE:
            raise ValueError(f"dram_segment_bytes must be 0 (no arena) or at least {2 * PAGE}, got {self.dram_segment_bytes}")
        if self.dram_dir is not None:
            parent = os.path.dirname(os.path.abspath(self.dram_dir))
            if not os.path.isdir(parent):
                raise FileNotFoundError(f"parent directory of dram_dir does not exist: {parent}")
