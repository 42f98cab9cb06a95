"""Prometheus metrics of one retrieval-index process; names ``tessera_index_*`` in base units.

What it holds is read from the index set at scrape time (one source of truth for ``/metrics`` and the Status RPC);
build and search latencies are histograms with explicit buckets; keys scanned is a counter, from which a reader
computes keys per search.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.cluster.serving import MetricsEndpoint

SEARCH_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
BUILD_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _HeldCollector:
    def __init__(self, indexes, chunk_indexes) -> None:
        self._indexes, self._chunk_indexes = indexes, chunk_indexes

    def collect(self):
        owners, kv, graph = self._indexes.held()
        yield GaugeMetricFamily("tessera_index_owners", "Owners (sequences) with offloaded K/V held", value=owners)
        yield GaugeMetricFamily("tessera_index_kv_bytes", "Offloaded K/V bytes held", value=kv)
        yield GaugeMetricFamily("tessera_index_index_bytes", "Bytes of the indexes over them", value=graph)
        paths = CounterMetricFamily("tessera_index_search_calls", "Search calls by the path that answered them: one "
                                    "compiled call for the layer's searches, or the thread pool (while it compiles)",
                                    labels=["path"])
        for path, calls in self._indexes.calls_by_path().items():
            paths.add_metric([path], calls)
        yield paths
        if self._chunk_indexes is not None:
            chunks, nbytes = self._chunk_indexes.held()
            yield GaugeMetricFamily("tessera_index_chunk_indexes", "Shared chunks' indexes held", value=chunks)
            yield GaugeMetricFamily("tessera_index_chunk_index_bytes", "Bytes of the chunks' indexes held",
                                    value=nbytes)


class IndexMetrics(MetricsEndpoint):
    def __init__(self, indexes, registry: CollectorRegistry | None = None, chunk_indexes=None) -> None:
        self.registry = registry or CollectorRegistry()
        self.registry.register(_HeldCollector(indexes, chunk_indexes))
        self.build_seconds = Histogram("tessera_index_build_seconds", "Building one (owner, layer)'s indexes",
                                       buckets=BUILD_BUCKETS, registry=self.registry)
        self.search_seconds = Histogram("tessera_index_search_seconds",
                                        "One Search call: a layer of a decode step for every row of the batch",
                                        buckets=SEARCH_BUCKETS, registry=self.registry)
        self.keys_scanned = Counter("tessera_index_keys_scanned",
                                    "Keys read by searches (once for the query heads of a group searched together)",
                                    registry=self.registry)
        self.keys_offloaded = Counter("tessera_index_keys_offloaded", "Keys offloaded and indexed",
                                      registry=self.registry)
