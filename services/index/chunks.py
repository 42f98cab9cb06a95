"""A chunk's retrieval indexes: one graph per (layer, KV head) over the chunk's keys, built once in the chunk's own
frame and reused by every request that places the chunk, at any offset.

Why one build serves every offset: a chunk's keys are cached rotated at chunk-local positions; placed at offset
``o``, each of them is rotated by ``o`` more (RoPE: one orthogonal map for the whole chunk). Distances between its
keys, all the graph was pruned and repaired by, do not change under it, and q'·k at offset o equals q·k' where
q' is the query rotated back by o (what the attention kernels do): a search of the composed index (the keys at
their global positions) walks the graph exactly as a search of the chunk's keys in their frame with the query
rotated back would. So the graph is kept, never the keys: a request composes the graphs of its chunks over the
keys it holds (``AttentionIndex.compose``), and those are its own K, so CacheBlend's recomputed tokens are
searched with their recomputed keys (the graph only guides the search; what it finds is attended exactly).

Training queries: a decode query sits far to the right of a chunk's own prefill queries, so the chunk's queries
are used rotated forward by several distances as well (the engine's ``CHUNK_QUERY_SHIFTS``): each stands for a
query that many positions after it.

Bytes (``to_bytes``): a fixed header, a blake2b digest, the payload::

    header   magic b"TSRCIDX\\0" | version u16 | reserved u16 (0) | layers u32 | heads u32 | length u32
             | config_len u32
    payload  config (JSON) | edges int64 [layers * heads] | entries int64 [layers * heads]
             | offsets int32 [layers * heads, length + 1] | targets int32 [sum edges] | entry ids int32 [sum entries]

``from_bytes`` checks the sizes, the digest and every graph's structure before a ``ChunkIndex`` exists, so a
damaged blob (a flipped bit in any tier) raises ``IndexFormatError`` and is never searched.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from services.index.build import BuildConfig, Graph, build_graph
from services.index.format import DIGEST_BYTES, IndexFormatError, check_structure, sealed, unsealed

MAGIC = b"TSRCIDX\x00"
VERSION = 1
_HEADER = struct.Struct("<8sHHIIII")
# NOTE: training queries of a chunk's (layer, KV head), at most: a 512-token chunk of an 8B-shaped model taps 128 of
# its tokens (x 4 query heads a KV head), 1 MiB a layer on the host in fp16 until its graphs are built, so that a
# 128K-token context's chunks wait in 16 GiB rather than 64
CHUNK_TRAIN_QUERIES = 512
# NOTE: no repair round in a chunk's own graphs: a request repairs the composition of its chunks' graphs with its own
# queries (heads.IndexSet.add), and that repair does their work. On the longgen model's Q/K in 384-key chunks
# (bench/index/README.md) the repaired composition's recall@100 at 20% of the keys read was 0.9295 with none against
# 0.9298 with the build's 2 rounds (0.5162 against 0.5153 composed alone), and a chunk's graph built in 40.7 ms against
# 93.0 (one thread): the start of a request whose chunks are new
CHUNK_REPAIR_ROUNDS = 0
# NOTE: a composed index's one beam spans many chunks and expands the best-scored keys first: a chunk is explored only
# when one of its entries scores well, so each starts searches from one key per ``KEYS_PER_ENTRY`` of it (its
# most-asked-for keys). Entries alone do not carry recall (bench/index/README.md: composed recall@100 0.59 at 20% of
# keys scored with 8 a 64-key chunk): the request's own queries repair the composition (heads.IndexSet.add), and
# every entry is a key each search scores
KEYS_PER_ENTRY = 64


@dataclass(frozen=True, slots=True)
class ChunkIndex:
    """graphs[layer][kv head]: a graph over the chunk's ``length`` keys at that layer and head."""

    length: int
    graphs: tuple[tuple[Graph, ...], ...]
    config: BuildConfig

    @classmethod
    def build(cls, keys: list[np.ndarray], train: list[np.ndarray], threads: int | None = None,
              **options) -> "ChunkIndex":
        """keys[layer] float32 [Hkv, L, D]: the chunk's keys in its frame; train[layer] float32 [Hkv, M, D]:
        queries in the same frame (the chunk's own, rotated forward). Every (layer, head) graph builds on its
        own thread (``threads``, default: this process' CPUs); the graphs do not depend on it."""
        if not keys or len(keys) != len(train):
            raise ValueError(f"need keys and training queries for every layer, got {len(keys)} and {len(train)}")
        options.setdefault("max_train_queries", CHUNK_TRAIN_QUERIES)
        options.setdefault("repair_rounds", CHUNK_REPAIR_ROUNDS)
        hkv, length, dim = keys[0].shape
        options.setdefault("entries", max(1, length // KEYS_PER_ENTRY))
        config = BuildConfig(**options)
        for layer, (k, q) in enumerate(zip(keys, train)):
            if k.shape != (hkv, length, dim) or q.ndim != 3 or q.shape[0] != hkv or q.shape[2] != dim or not q.shape[1]:
                raise ValueError(f"layer {layer}: keys {k.shape} and queries {q.shape} do not match "
                                 f"[{hkv}, {length}, {dim}] and [{hkv}, M >= 1, {dim}]")
        jobs = [(layer, h) for layer in range(len(keys)) for h in range(hkv)]

        def one(job):
            layer, h = job
            k = np.ascontiguousarray(keys[layer][h], np.float32)
            q = np.ascontiguousarray(train[layer][h], np.float32)
            return build_graph(k, q, config, threads=1)

        # each graph's exact lists on its own thread's one OpenMP thread (build.exact_lists)
        with ThreadPoolExecutor(threads or len(os.sched_getaffinity(0)), thread_name_prefix="chunk-index") as pool:
            built = list(pool.map(one, jobs))
        graphs = tuple(tuple(built[layer * hkv:(layer + 1) * hkv]) for layer in range(len(keys)))
        return cls(length, graphs, config)

    @property
    def num_layers(self) -> int:
        return len(self.graphs)

    @property
    def num_heads(self) -> int:
        return len(self.graphs[0])

    @property
    def nbytes(self) -> int:
        """Bytes of its graphs in memory."""
        return sum(g.offsets.nbytes + g.targets.nbytes + g.entries.nbytes for gs in self.graphs for g in gs)

    def to_bytes(self) -> bytes:
        flat = [g for gs in self.graphs for g in gs]
        config = json.dumps(self.config.as_dict(), sort_keys=True).encode()
        header = _HEADER.pack(MAGIC, VERSION, 0, self.num_layers, self.num_heads, self.length, len(config))
        payload = [config,
                   np.array([g.targets.shape[0] for g in flat], "<i8").tobytes(),
                   np.array([g.entries.shape[0] for g in flat], "<i8").tobytes(),
                   np.concatenate([g.offsets for g in flat]).astype("<i4").tobytes(),
                   np.concatenate([g.targets for g in flat]).astype("<i4").tobytes(),
                   np.concatenate([g.entries for g in flat]).astype("<i4").tobytes()]
        return sealed(header, payload)

    @classmethod
    def from_bytes(cls, blob) -> "ChunkIndex":
        """The index ``to_bytes`` wrote; ``IndexFormatError`` (a ValueError) for anything else."""
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise IndexFormatError(f"chunk index must be bytes, got {type(blob).__name__}")
        view = memoryview(blob).cast("B")
        if len(view) < _HEADER.size + DIGEST_BYTES:
            raise IndexFormatError(f"chunk index of {len(view)} bytes is shorter than its header")
        header = bytes(view[:_HEADER.size])
        magic, version, reserved, layers, heads, length, config_len = _HEADER.unpack(header)
        if magic != MAGIC:
            raise IndexFormatError("blob is not a chunk index (bad magic)")
        if version != VERSION:
            raise IndexFormatError(f"chunk index format version {version}, this build reads version {VERSION} only")
        if reserved != 0 or layers < 1 or heads < 1 or length < 1:
            raise IndexFormatError(f"chunk index header names {layers} layers, {heads} heads, {length} keys")
        n = layers * heads
        start = _HEADER.size + DIGEST_BYTES
        fixed = config_len + 16 * n + 4 * n * (length + 1)
        if start + fixed > len(view):
            raise IndexFormatError(f"chunk index of {len(view)} bytes is shorter than its header describes")
        counts = np.frombuffer(view[start + config_len:start + config_len + 16 * n], "<i8").reshape(2, n)
        if (counts < 0).any() or (counts[1] < 1).any():
            raise IndexFormatError("chunk index names negative edge or entry counts")
        sizes = [config_len, 8 * n, 8 * n, 4 * n * (length + 1), 4 * int(counts[0].sum()), 4 * int(counts[1].sum())]
        payload = unsealed(view, _HEADER.size, sizes, "chunk index")
        try:
            config = BuildConfig(**json.loads(bytes(payload[0])))
        except (TypeError, ValueError) as exc:
            raise IndexFormatError(f"chunk index options are not this version's: {exc}") from None
        offsets = np.frombuffer(payload[3], "<i4").reshape(n, length + 1).astype(np.int64)
        targets = np.split(np.frombuffer(payload[4], "<i4").astype(np.int32), np.cumsum(counts[0])[:-1])
        entries = np.split(np.frombuffer(payload[5], "<i4").astype(np.int64), np.cumsum(counts[1])[:-1])
        flat = []
        for i in range(n):
            check_structure(length, offsets[i], targets[i], entries[i])
            flat.append(Graph(offsets[i].copy(), targets[i], entries[i]))
        return cls(length, tuple(tuple(flat[layer * heads:(layer + 1) * heads]) for layer in range(layers)), config)


class ChunkIndexCache:
    """Built chunk indexes by chunk id, least recently used first out past ``max_bytes`` (host memory; the chunk's
    KV may leave the GPU and come back, its index stays). Thread safe."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, ChunkIndex] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> ChunkIndex | None:
        with self._lock:
            index = self._items.get(key)
            if index is not None:
                self._items.move_to_end(key)
            return index

    def put(self, key: str, index: ChunkIndex) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._items[key] = index
            self._bytes += index.nbytes
            while self._bytes > self.max_bytes and self._items:
                _, gone = self._items.popitem(last=False)
                self._bytes -= gone.nbytes

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._items

    def held(self) -> tuple[int, int]:
        """(chunk indexes, bytes) held now."""
        with self._lock:
            return len(self._items), self._bytes
