"""Where a chunk's KV comes from, defined once for the store, the workers, the SDK's users and the load
generator (no dependency: every layer may import it). Best first:

- ``gpu``: the worker's own GPU chunk cache;
- ``host``: the worker's own host-memory tier (services/cluster/hostcache.py);
- ``dram``, ``rocksdb``, ``s3``: the KV store's tiers (``STORE_TIERS``; the proto's ``Tier`` values are
  mapped next to the store, services/kvstore/chunk.py);
- ``computed``: no tier held it (a miss): computed from scratch.

These are the keys of a request's ``chunk_tokens_by_tier`` and the ``tier`` label of the metrics.
"""

from __future__ import annotations

from enum import Enum


class Tier(str, Enum):
    GPU = "gpu"
    HOST = "host"
    DRAM = "dram"
    ROCKSDB = "rocksdb"
    S3 = "s3"
    COMPUTED = "computed"

    # NOTE: the value, not "Tier.GPU", wherever a tier becomes text (a metric label, an f-string, a log line)
    __str__ = str.__str__
    __format__ = str.__format__


TIER_ORDER: tuple[Tier, ...] = tuple(Tier)
STORE_TIERS: tuple[Tier, ...] = (Tier.DRAM, Tier.ROCKSDB, Tier.S3)
