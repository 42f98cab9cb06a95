"""Prometheus metrics of the gateway; names ``tessera_gateway_*`` in base units."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_GAP = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("tessera_gateway_ttft_seconds", "Arrival to first token sent", buckets=LATENCY,
                              registry=r)
        self.tpot = Histogram("tessera_gateway_tpot_seconds", "Time per output token after the first",
                              buckets=TOKEN_GAP, registry=r)
        self.e2e = Histogram("tessera_gateway_e2e_seconds", "Arrival to last token sent", buckets=LATENCY, registry=r)
        self.queue = Histogram("tessera_gateway_queue_seconds", "Arrival until a prefill worker started on it",
                               buckets=LATENCY, registry=r)
        self.requests = Counter("tessera_gateway_requests", "Generate requests by outcome", ["outcome"], registry=r)
        self.retries = Counter("tessera_gateway_retries", "Requests sent again after a worker failed", ["role"],
                               registry=r)
        self.output_tokens = Counter("tessera_gateway_output_tokens", "Tokens streamed to clients", registry=r)
        self.chunk_tokens = Counter("tessera_gateway_chunk_tokens", "Chunk tokens by where their KV came from",
                                    ["tier"], registry=r)
        self.in_flight = Gauge("tessera_gateway_in_flight", "Generate calls in progress", registry=r)
        self.healthy = Gauge("tessera_gateway_healthy_workers", "Workers passing health checks", ["role"], registry=r)
