"""Prometheus metrics of one store process; names ``tessera_kvstore_*`` in base units.

Per-tier counters are read from the store's own counters at scrape time (one source of truth for
both ``/metrics`` and the Stats RPC); latencies are histograms with explicit buckets. Hit rates
are computed from the counters by the reader, never stored.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.cluster.serving import MetricsEndpoint

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _TierCollector:
    def __init__(self, store) -> None:
        self._store = store

    def collect(self):
        fams = {
            "hits": CounterMetricFamily("tessera_kvstore_hits", "Reads served by the tier", labels=["tier"]),
            "misses": CounterMetricFamily("tessera_kvstore_misses", "Reads that found no copy in the tier", labels=["tier"]),
            "evictions": CounterMetricFamily("tessera_kvstore_evictions", "Chunks evicted to stay in budget", labels=["tier"]),
            "bytes_in": CounterMetricFamily("tessera_kvstore_written_bytes", "K/V bytes written into the tier", labels=["tier"]),
            "bytes_out": CounterMetricFamily("tessera_kvstore_read_bytes", "Verified K/V bytes read from the tier", labels=["tier"]),
            "corrupt": CounterMetricFamily("tessera_kvstore_corrupt_entries", "Entries that failed a check and were dropped", labels=["tier"]),
        }
        resident = GaugeMetricFamily("tessera_kvstore_resident_bytes", "K/V bytes resident in the tier", labels=["tier"])
        chunks = GaugeMetricFamily("tessera_kvstore_resident_chunks", "Chunks resident in the tier", labels=["tier"])
        budget = GaugeMetricFamily("tessera_kvstore_budget_bytes", "Byte budget of the tier", labels=["tier"])
        for slot in self._store.slots:
            for key, fam in fams.items():
                fam.add_metric([slot.name], getattr(slot.counters, key))
            if slot.residency is not None:
                resident.add_metric([slot.name], slot.residency.used)
                chunks.add_metric([slot.name], len(slot.residency.sizes))
                budget.add_metric([slot.name], slot.residency.budget)
        yield from fams.values()
        yield from (resident, chunks, budget)
        arena = self._store.arena
        if arena is not None:       # the DRAM tier's arena: room it can use, and chunks it had none for
            free = GaugeMetricFamily("tessera_kvstore_arena_free_bytes", "Room in the DRAM arena: free, resting "
                                     "(freed, reusable after the grace) and not yet made into segments")
            free.add_metric([], arena.free_bytes())
            yield free
            unplaced = CounterMetricFamily("tessera_kvstore_arena_unplaced", "Chunks the DRAM arena had no room for, "
                                           "kept as files of their own (read the slower, per-file way)")
            unplaced.add_metric([], self._store.slots[0].storage.unplaced)
            yield unplaced


class StoreMetrics(MetricsEndpoint):
    def __init__(self, store, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.registry.register(_TierCollector(store))
        self.get_seconds = Histogram("tessera_kvstore_get_seconds", "Whole Get stream, by the tier that served it",
                                     ["tier"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.first_layer_seconds = Histogram("tessera_kvstore_get_first_layer_seconds", "Get request to first layer sent",
                                             ["tier"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.local_gets = Counter("tessera_kvstore_local_gets", "Gets answered with the shared-memory file of the "
                                  "chunk, read by the caller on this host", registry=self.registry)
        self.staged_gets = Counter("tessera_kvstore_staged_gets", "Gets of a chunk from a lower tier, for a caller "
                                   "that reads the DRAM arena itself, staged through it first", registry=self.registry)
        self.nixl_gets = Counter("tessera_kvstore_nixl_gets", "Gets answered with where the chunk's layers lie in this "
                                 "store's registered memory, read by the caller over NIXL", registry=self.registry)
        self.put_seconds = Histogram("tessera_kvstore_put_seconds", "Put stream from first message to acknowledgement",
                                     buckets=LATENCY_BUCKETS, registry=self.registry)
