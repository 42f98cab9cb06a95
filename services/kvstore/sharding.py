"""Client-side sharding: chunk ids map to store shards by consistent hashing.

Each shard address owns ``vnodes`` points on a 64-bit ring (blake2b of "address#i"); a chunk goes
to the first point at or after the hash of its id. Adding a shard moves only the chunks that now
hash to the new shard's points (about 1/N of them), and each of those moves to the new shard:
every other chunk keeps its owner. A moved chunk is a miss on its new owner until re-put.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable, Iterator, Sequence

import torch

from services.kvstore.client import ChunkLocation, KVStoreClient, PutResult


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, nodes: Iterable[str] = (), vnodes: int = 128) -> None:
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        self.vnodes = vnodes
        self._points: list[int] = []
        self._owners: list[str] = []
        self.nodes: list[str] = []
        for node in nodes:
            self.add(node)

    def add(self, node: str) -> None:
        if node in self.nodes:
            raise ValueError(f"shard {node} is already on the ring")
        self.nodes.append(node)
        for i in range(self.vnodes):
            point = _hash(f"{node}#{i}")
            at = bisect.bisect_left(self._points, point)
            self._points.insert(at, point)
            self._owners.insert(at, node)

    def remove(self, node: str) -> None:
        if node not in self.nodes:
            raise ValueError(f"shard {node} is not on the ring")
        self.nodes.remove(node)
        keep = [(p, o) for p, o in zip(self._points, self._owners) if o != node]
        self._points = [p for p, _ in keep]
        self._owners = [o for _, o in keep]

    def node_for(self, key: str) -> str:
        if not self._points:
            raise ValueError("the ring has no shards")
        at = bisect.bisect_left(self._points, _hash(key))
        return self._owners[at % len(self._points)]


class ShardedKVStoreClient:
    """The KVStoreClient API over several shards; ``lookup`` batches per shard."""

    def __init__(self, addresses: Sequence[str], *, vnodes: int = 128, **client_kwargs) -> None:
        if not addresses:
            raise ValueError("at least one shard address is needed")
        self._client_kwargs = client_kwargs
        self._clients: dict[str, KVStoreClient] = {}
        self.ring = HashRing(vnodes=vnodes)
        for address in addresses:
            self.add_shard(address)

    def add_shard(self, address: str) -> None:
        self.ring.add(address)
        self._clients[address] = KVStoreClient(address, **self._client_kwargs)

    def remove_shard(self, address: str) -> None:
        self.ring.remove(address)
        self._clients.pop(address).close()

    def shard_for(self, chunk_id: str) -> str:
        return self.ring.node_for(chunk_id)

    def client_for(self, chunk_id: str) -> KVStoreClient:
        return self._clients[self.shard_for(chunk_id)]

    def put(self, chunk_id: str, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], *,
            model_fingerprint: str = "", timeout: float | None = None) -> PutResult:
        return self.client_for(chunk_id).put(chunk_id, layers, model_fingerprint=model_fingerprint, timeout=timeout)

    def get(self, chunk_id: str, *, layers: tuple[int, int] | None = None, timeout: float | None = None,
            device: torch.device | None = None, place=None) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        return self.client_for(chunk_id).get(chunk_id, layers=layers, timeout=timeout, device=device, place=place)

    def lookup(self, chunk_ids: Sequence[str], *, timeout: float | None = None) -> list[ChunkLocation]:
        by_shard: dict[str, list[str]] = {}
        for chunk_id in chunk_ids:
            by_shard.setdefault(self.shard_for(chunk_id), []).append(chunk_id)
        found: dict[str, ChunkLocation] = {}
        for address, ids in by_shard.items():
            for loc in self._clients[address].lookup(ids, timeout=timeout):
                found[loc.chunk_id] = loc
        return [found[c] for c in chunk_ids]

    def delete(self, chunk_id: str, *, timeout: float | None = None) -> bool:
        return self.client_for(chunk_id).delete(chunk_id, timeout=timeout)

    def clients(self) -> list[KVStoreClient]:
        return list(self._clients.values())

    def in_arena(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a view of some shard's arena (``KVStoreClient.in_arena``)."""
        return any(c.in_arena(t) for c in self._clients.values())

    def stats(self, *, timeout: float | None = None) -> dict:
        return {address: c.stats(timeout=timeout) for address, c in self._clients.items()}

    def close(self) -> None:
        for client in self._clients.values():
            client.close()

    def __enter__(self) -> "ShardedKVStoreClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
