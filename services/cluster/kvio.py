"""Workers' access to the KV store shards: lookup, layer-streamed fetch, background put.

The store is an accelerator, never a dependency: a shard that is down or slow makes its chunks
misses (the worker computes them), a failed put is counted and dropped. A shard that failed is
skipped for ``backoff_s`` so that requests do not each pay its timeout; Ray restarts it on the
same address and it is tried again after that.

With ``host_bytes`` > 0 the worker also keeps the chunks it writes to or reads from the store in its
own host memory (``hostcache.HostChunks``, tier "host"), looked up before the shards.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import grpc

from services.cluster.hostcache import HostChunks
from services.engine.kv.chunk_ids import index_entry_id
from services.kvstore.client import ChunkCorruptError
from services.engine.kv.loader import StreamedLayer
from services.tiers import Tier

if TYPE_CHECKING:
    from services.rpc import kvstore_pb2 as pb

log = logging.getLogger(__name__)

MAX_PLACES = 4096       # chunk places from lookups kept for the fetches that follow them


class DeviceLayers:
    """A chunk read from this host's store arena onto the GPU (``KVStoreClient.device_read``) as the engine takes a
    fetch: ``local`` (every layer queued at once, landing within milliseconds) and checked later: the engine calls
    ``verify()`` before any layer is used, and recomputes the chunk if it raises (services/engine/kv/loader.py)."""

    local = True

    def __init__(self, read) -> None:
        self._read = read

    def __iter__(self) -> Iterator[StreamedLayer]:
        for layer, k, v in self._read:
            yield StreamedLayer(layer, k, v)

    def verify(self) -> None:
        self._read.verify()


class StoreAccess:
    def __init__(self, addresses: Sequence[str], *, lookup_timeout: float = 2.0, get_timeout: float = 30.0,
                 put_timeout: float = 30.0, backoff_s: float = 2.0, max_pending_puts: int = 64,
                 on_error: Callable[[str], None] | None = None, host_bytes: int = 0, tls=None,
                 nixl: bool = False) -> None:
        from services.kvstore import ShardedKVStoreClient

        self.addresses = list(addresses)
        # tls: the worker's ClusterTLS (the store is reached over mutual TLS), None: plain channels. A shard on this
        # host with its DRAM tier in shared memory is read from its files (into pinned memory on a GPU host); with
        # ``nixl``, a shard on another host running a NIXL agent is read from its memory over NIXL
        import torch

        self._client = (ShardedKVStoreClient(self.addresses, timeout=put_timeout, tls=tls, local=True,
                                             pin=torch.cuda.is_available(), nixl=nixl) if self.addresses else None)
        self.host = HostChunks(host_bytes) if host_bytes > 0 else None
        self.lookup_timeout, self.get_timeout, self.put_timeout = lookup_timeout, get_timeout, put_timeout
        self.backoff_s = backoff_s
        self.max_pending_puts = max_pending_puts
        self._down_until: dict[str, float] = {}
        self._pending = 0
        self._lock = threading.Lock()
        self._puts = ThreadPoolExecutor(1, thread_name_prefix="kv-put")
        self._keeper = ThreadPoolExecutor(1, thread_name_prefix="kv-keep")
        self._on_error = on_error or (lambda _kind: None)
        self.put_bytes = 0
        self.put_errors = 0
        self.known_ids: set[str] = set()     # chunk ids this worker stored (dropped by reset)
        # chunks' places in this host's store arena, from the last lookups (pb.LocalChunk by chunk id): a fetch reads
        # them without a Get. Bounded: the oldest go first
        self._places: OrderedDict[str, pb.LocalChunk] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self._client is not None or self.host is not None

    def _up(self, shard: str) -> bool:
        return time.monotonic() >= self._down_until.get(shard, 0.0)

    def _failed(self, shard: str, kind: str, exc: Exception) -> None:
        self._down_until[shard] = time.monotonic() + self.backoff_s
        self._on_error(kind)
        log.warning("kv store %s %s failed: %s", shard, kind, getattr(exc, "details", lambda: exc)())

    def lookup(self, chunk_ids: Sequence[str], host: bool = True) -> dict[str, Tier]:
        """{chunk id: fastest tier holding it} for the ids this worker's host tier (unless ``host`` is
        False) or some reachable shard holds."""
        found: dict[str, Tier] = {}
        rest = list(dict.fromkeys(chunk_ids))
        if host and self.host is not None:
            found = {cid: Tier.HOST for cid in rest if cid in self.host}
            rest = [cid for cid in rest if cid not in found]
        if self._client is None or not rest:
            return found
        by_shard: dict[str, list[str]] = {}
        for cid in rest:
            by_shard.setdefault(self._client.shard_for(cid), []).append(cid)
        for shard, ids in by_shard.items():
            if not self._up(shard):
                continue
            try:
                for loc in self._client.client_for(ids[0]).lookup(ids, timeout=self.lookup_timeout):
                    if loc.found and loc.tiers:
                        found[loc.chunk_id] = loc.tiers[0]
                    if loc.place is not None:
                        with self._lock:
                            self._places[loc.chunk_id] = loc.place
                            self._places.move_to_end(loc.chunk_id)
                            while len(self._places) > MAX_PLACES:
                                self._places.popitem(last=False)
            except grpc.RpcError as exc:
                self._failed(shard, "lookup", exc)
        return found

    def fetcher(self, present: dict[str, Tier], device=None) -> Callable[[str], Iterator | None]:
        """``fetch(chunk_id)`` for the engine: a layer stream for chunks ``lookup`` found, else None.
        A stream that breaks midway is recomputed by the engine. ``device``: the engine's CUDA device, where layers
        from this host's store arena are copied and checked by the read (``KVStoreClient.get``)."""
        def fetch(cid: str):
            if cid not in present:
                return None
            if present[cid] == Tier.HOST:
                entry = self.host.get(cid)
                if entry is not None:
                    return entry.stream()
                # evicted since the lookup: the store may still hold it
            if self._client is None:
                return None
            with self._lock:
                place = self._places.pop(cid, None)       # one read a place: the next lookup gives a fresh one
            if place is not None and device is not None:
                try:
                    read = self._client.client_for(cid).device_read(cid, place, device)
                except ChunkCorruptError as exc:    # a place that names another chunk or lies past its segment
                    log.warning("chunk %s: its looked-up place is unusable (%s); read by a Get", cid[:12], exc)
                    read = place = None
                if read is not None:        # this host's arena onto the GPU: all at once, checked before use
                    return DeviceLayers(read)
            stream = (StreamedLayer(layer, k, v)
                      for layer, k, v in self._client.get(cid, timeout=self.get_timeout, device=device, place=place))
            return stream if self.host is None else self._keeping(cid, stream)
        return fetch

    def _keeping(self, cid: str, stream: Iterator) -> Iterator:
        """``stream`` passed through; its layers kept in the host tier once it has ended whole (pinned
        first on a GPU host, by the keeper thread: the reader does not wait for that copy). Not a chunk read from
        this host's store arena: it is a pinned-rate copy away already (its views are the store's memory, or it came
        onto the GPU already)."""
        layers = []
        for item in stream:
            if layers is not None and (item.k.device.type != "cpu" or self.in_arena(item.k)):
                layers = None
            if layers is not None:
                layers.append((item.k, item.v))
            yield item
        if layers is not None:
            self._keeper.submit(self._keep, cid, layers)

    def _keep(self, cid: str, layers) -> None:
        import torch

        if torch.cuda.is_available():
            layers = [(k.pin_memory(), v.pin_memory()) for k, v in layers]
        self.host.put(cid, layers)

    def read_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """(gets by how their bytes came, reads of this host's tier that went on by the stream by why), over the
        shards (``KVStoreClient.reads`` and ``fallbacks``)."""
        from services.kvstore.client import FALLBACKS, READ_PATHS

        reads, fallbacks = dict.fromkeys(READ_PATHS, 0), dict.fromkeys(FALLBACKS, 0)
        for client in ([] if self._client is None else self._client.clients()):
            for total, counts in ((reads, client.reads), (fallbacks, client.fallbacks)):
                for key, n in counts.items():
                    total[key] += n
        return reads, fallbacks

    def in_arena(self, t) -> bool:
        """Whether ``t`` is a view of this host's store arena (``KVStoreClient.in_arena``)."""
        return self._client is not None and self._client.in_arena(t)

    def prefetch(self, chunk_ids: Sequence[str]) -> int:
        """Read the chunks the shards hold into the host tier (blocking); returns how many of ``chunk_ids``
        it holds afterwards. Without a host tier, 0."""
        if self.host is None:
            return 0
        present = self.lookup(chunk_ids)
        fetch = self.fetcher(present)
        for cid, tier in present.items():
            if tier == Tier.HOST:
                continue
            try:
                for _ in fetch(cid):
                    pass
            except (grpc.RpcError, ValueError) as exc:
                log.warning("prefetch of chunk %s failed: %s", cid[:12], exc)
        self._keeper.submit(lambda: None).result()       # the keeps queued above are done
        return sum(1 for cid in chunk_ids if cid in self.host)

    def put_later(self, chunk_id: str, layers, fingerprint: str = "") -> bool:
        """Keep the chunk in the host tier and queue a store put; False when no put was queued (no
        store, too many pending, or the shard is backing off)."""
        queued = False
        if self._client is not None:
            shard = self._client.shard_for(chunk_id)
            with self._lock:
                if self._pending < self.max_pending_puts and self._up(shard):
                    self._pending += 1
                    queued = True
        if not queued and self.host is None:
            return False
        layers, ready = self._to_host(layers)
        if self.host is not None:
            self.host.put(chunk_id, layers, ready)
        if queued:
            self._puts.submit(self._put, chunk_id, layers, fingerprint, ready)
        return queued

    @staticmethod
    def _to_host(layers):
        """GPU layers -> pinned host copies made off the engine's stream (``copy_aside``), and the event
        that marks them done; host layers as they are."""
        if not layers or not layers[0][0].is_cuda:
            return layers, None
        import torch

        from services.cluster.staging import copy_aside

        flat, ready = copy_aside([t for kv in layers for t in kv], torch.device("cpu"))
        return list(zip(flat[0::2], flat[1::2])), ready

    def put_async(self, chunk_id: str, layers, fingerprint: str = "") -> Future:
        """Store a chunk (and keep it in the host tier) without waiting: the device-to-host copy is queued
        here (the caller's thread), the store write runs on the put thread; the future's result is True
        once the store acknowledged the chunk (False: no store, or the put failed). The caller may compute
        the next chunk meanwhile."""
        ready = None
        if self.host is not None or (layers and layers[0][0].is_cuda):
            layers, ready = self._to_host(layers)
            if self.host is not None:
                self.host.put(chunk_id, layers, ready)
        if self._client is None:
            done: Future = Future()
            done.set_result(False)
            return done
        with self._lock:
            self._pending += 1
        return self._puts.submit(self._put, chunk_id, layers, fingerprint, ready)

    def _put(self, chunk_id: str, layers, fingerprint: str, ready=None) -> bool:
        try:
            if ready is not None:
                ready.synchronize()
            res = self._client.put(chunk_id, layers, model_fingerprint=fingerprint, timeout=self.put_timeout)
            self._down_until.pop(self._client.shard_for(chunk_id), None)    # it answers again
            self.put_bytes += res.nbytes
            self.known_ids.add(chunk_id)
            return True
        except (grpc.RpcError, ValueError) as exc:
            self.put_errors += 1
            self._failed(self._client.shard_for(chunk_id), "put", exc)
            return False
        finally:
            with self._lock:
                self._pending -= 1

    def get_blob(self, entry_id: str) -> bytes | None:
        """An entry of bytes (``KVStoreClient.put_bytes``) from its shard, or None when no reachable shard holds
        it or it arrives damaged (the store checks every layer it serves)."""
        if self._client is None:
            return None
        shard = self._client.shard_for(entry_id)
        if not self._up(shard):
            return None
        try:
            return self._client.client_for(entry_id).get_bytes(entry_id, timeout=self.get_timeout)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                self._failed(shard, "get", exc)
            return None
        except ChunkCorruptError as exc:
            log.warning("kv store entry %s refused: %s", entry_id[:16], exc)
            return None

    def put_blob_later(self, entry_id: str, blob: bytes) -> Future | None:
        """Store an entry of bytes on the put thread (best effort, as chunk puts); None when there is no store."""
        if self._client is None:
            return None

        def put() -> bool:
            try:
                self._client.client_for(entry_id).put_bytes(entry_id, blob, timeout=self.put_timeout)
                return True
            except (grpc.RpcError, ValueError) as exc:
                self.put_errors += 1
                self._failed(self._client.shard_for(entry_id), "put", exc)
                return False

        return self._puts.submit(put)

    def drop_known(self) -> int:
        """Delete every chunk this worker stored, and empty its host tier (cold start between benchmark
        modes). Returns how many the store deleted."""
        if self.host is not None:
            self.host.clear()
        return self._delete(list(self.known_ids))

    def forget(self, chunk_ids, store: bool) -> int:
        """Drop these chunks from the host tier and, with ``store`` (a prefill worker, which may delete), from
        the store too; returns how many the store deleted."""
        if self.host is not None:
            self.host.drop(chunk_ids)
        if store:
            return self._delete(chunk_ids)
        self.known_ids.difference_update(chunk_ids)
        return 0

    def _delete(self, chunk_ids) -> int:
        """Delete these chunks from the store (best effort); returns how many it held."""
        dropped = 0
        for cid in chunk_ids:
            if self._client is not None:
                try:
                    dropped += bool(self._client.delete(cid, timeout=self.lookup_timeout))
                except grpc.RpcError:
                    pass
            self.known_ids.discard(cid)
        return dropped

    def close(self) -> None:
        self._puts.shutdown(wait=False, cancel_futures=True)
        self._keeper.shutdown(wait=False, cancel_futures=True)
        if self._client is not None:
            self._client.close()


class ChunkIndexStore:
    """Chunks' retrieval indexes in the store, beside their KV (``Forward.chunk_index_store``): ``get(chunk id)`` the
    bytes a worker stored (the engine checks them before any use), ``put(chunk id, bytes)`` in the background,
    ``drop(chunk id)`` a copy the engine refused (entries are write-once: a put does not replace one). Each is an entry
    of bytes under ``index_entry_id`` of the chunk, so its tiers, checksums and eviction are a chunk's."""

    def __init__(self, store: StoreAccess) -> None:
        self.store = store

    def get(self, chunk_id: str) -> bytes | None:
        return self.store.get_blob(index_entry_id(chunk_id))

    def put(self, chunk_id: str, blob: bytes) -> None:
        self.store.put_blob_later(index_entry_id(chunk_id), blob)

    def drop(self, chunk_id: str) -> None:
        self.store.forget([index_entry_id(chunk_id)], store=True)


class StoreReadMetrics:
    """A Prometheus collector of a worker's store reads (``StoreAccess.read_counts``), read at scrape time:
    ``<prefix>_store_reads_total{path}`` and ``<prefix>_store_read_fallbacks_total{why}``."""

    def __init__(self, store: StoreAccess, prefix: str) -> None:
        self.store, self.prefix = store, prefix

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        reads, fallbacks = self.store.read_counts()
        by_path = CounterMetricFamily(f"{self.prefix}_store_reads", "Chunk reads from the KV store by how their bytes "
                                      "came: arena-device (this host's shared-memory arena, copied onto the GPU and "
                                      "checked there), arena (its views, checked on the CPU), file (a file of this "
                                      "host's tier), stream (gRPC)", labels=["path"])
        for path, n in reads.items():
            by_path.add_metric([path], n)
        yield by_path
        why = CounterMetricFamily(f"{self.prefix}_store_read_fallbacks", "Reads of this host's store tier that went "
                                  "on by the gRPC stream: gone (evicted before the read), moved (its extent reused), "
                                  "damaged (a layer failed its CRC-32)", labels=["why"])
        for reason, n in fallbacks.items():
            why.add_metric([reason], n)
        yield why

