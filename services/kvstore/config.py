"""Configuration of one KV store process, checked once at construction."""

from __future__ import annotations

import os
from dataclasses import dataclass

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

    def __post_init__(self) -> None:
        if self.dram_bytes <= 0:
            raise ValueError(f"dram_bytes must be positive, got {self.dram_bytes}")
        if self.rocksdb_dir is not None:
            if self.rocksdb_bytes <= 0:
                raise ValueError(f"rocksdb_bytes must be positive, got {self.rocksdb_bytes}")
            parent = os.path.dirname(os.path.abspath(self.rocksdb_dir))
            if not os.path.isdir(parent):
                raise FileNotFoundError(f"parent directory of --rocksdb-dir does not exist: {parent}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.write_mode not in WRITE_MODES:
            raise ValueError(f"write_mode must be one of {WRITE_MODES}, got {self.write_mode!r}")
        if not 4096 <= self.frame_bytes <= 3 * MiB:
            # gRPC's default message limit is 4 MiB; frames leave room for the envelope.
            raise ValueError(f"frame_bytes must be within [4096, 3 MiB], got {self.frame_bytes}")
        if self.max_chunk_bytes <= 0:
            raise ValueError(f"max_chunk_bytes must be positive, got {self.max_chunk_bytes}")
