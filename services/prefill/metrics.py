"""Prometheus metrics of a prefill worker; names ``tessera_prefill_*`` in base units."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RATIO = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0)


class PrefillMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.chunks = Counter("tessera_prefill_chunk_hits", "Chunks by where their KV came from "
                              "(gpu: device cache, dram/rocksdb/s3: KV store tier, computed: miss)", ["tier"], registry=r)
        self.chunk_tokens = Counter("tessera_prefill_chunk_tokens", "Chunk tokens by where their KV came from",
                                    ["tier"], registry=r)
        self.recomputed = Counter("tessera_prefill_recomputed_tokens", "Chunk tokens recomputed by the blend step",
                                  registry=r)
        self.loaded_bytes = Counter("tessera_prefill_loaded_bytes", "Chunk KV bytes streamed from the store",
                                    registry=r)
        self.stored_bytes = Counter("tessera_prefill_stored_bytes", "Chunk KV bytes written to the store", registry=r)
        self.store_errors = Counter("tessera_prefill_store_errors", "Failed store calls", ["call"], registry=r)
        self.load_failures = Counter("tessera_prefill_load_failures", "Chunk streams that broke and were recomputed",
                                     registry=r)
        self.handoff_bytes = Counter("tessera_prefill_handoff_bytes", "Hand-off bytes sent to decode workers",
                                     registry=r)
        self.handoffs = Counter("tessera_prefill_handoffs", "Hand-offs by the transport that moved their K/V "
                                "(cuda-ipc: to this GPU's decode worker, cuda-ipc-peer: to another GPU of this host, "
                                "nixl, grpc: the stream)", ["transport"], registry=r)
        self.requests = Counter("tessera_prefill_requests", "Prefill requests by outcome", ["outcome"], registry=r)
        self.seconds = Histogram("tessera_prefill_seconds", "Prefill time per request, from its pass being "
                                 "issued to its hand-off exported (the next request's pass may be issued "
                                 "in between)", buckets=SECONDS, registry=r)
        self.engine_seconds = Counter("tessera_prefill_engine_seconds", "Engine-thread time spent on prefill "
                                      "requests (issuing passes, finishing them)", registry=r)
        self.queue_seconds = Histogram("tessera_prefill_queue_seconds", "Wait for the engine before prefill",
                                       buckets=SECONDS, registry=r)
        self.load_wait = Histogram("tessera_prefill_load_wait_seconds", "Prefill time spent waiting on store layers",
                                   buckets=SECONDS, registry=r)
        self.handoff_seconds = Histogram("tessera_prefill_handoff_seconds", "Serialising and pushing a hand-off "
                                         "to the decode worker", buckets=SECONDS, registry=r)
        self.ratio = Histogram("tessera_prefill_recompute_ratio", "Recompute ratio used", buckets=RATIO, registry=r)
        self.in_flight = Gauge("tessera_prefill_in_flight", "Requests in this worker", registry=r)
