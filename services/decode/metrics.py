"""Prometheus metrics of a decode worker; names ``tessera_decode_*`` in base units.

What the decode policies read is counted per policy when a request's sequence ends (from its DecodeStats, in pages
per KV head and layer), so the share of the KV a policy reads is a ratio of counters:
``rate(tessera_decode_pages_read_total[5m]) / rate(tessera_decode_pages_visible_total[5m])`` by ``policy``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from services.engine.decode import DecodeStats

SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class DecodeMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.handoff_bytes = Counter("tessera_decode_handoff_bytes", "Hand-off bytes received", registry=r)
        self.handoffs_dropped = Counter("tessera_decode_handoffs_dropped", "Hand-offs parked past handoff_wait_s "
                                        "with no Decode call for them (dropped)", registry=r)
        self.handoffs = Counter("tessera_decode_handoffs", "Hand-offs received by kind", ["kind"], registry=r)
        self.store_errors = Counter("tessera_decode_store_errors", "Failed store calls (the shard is then skipped for a "
                                    "moment and its chunks computed)", ["call"], registry=r)
        self.chunks = Counter("tessera_decode_chunks", "Shared chunks of hand-offs by where the decode worker found "
                              "them (gpu: its cache, store: prefetched, computed: neither)", ["source"], registry=r)
        self.store_wait_seconds = Histogram("tessera_decode_store_wait_seconds", "Time a hand-off waited for chunks "
                                            "the prefill worker was still writing to the store", buckets=SECONDS,
                                            registry=r)
        self.admitted = Counter("tessera_decode_admitted", "Sequences admitted into the batch", registry=r)
        self.admission_reads = Counter("tessera_decode_admission_reads", "Shared chunks an admission read from the "
                                       "store on the engine thread (the batch waiting), past the restages",
                                       registry=r)
        self.restaged = Counter("tessera_decode_restaged", "Hand-offs sent back at admission to have chunks read off "
                                "the engine thread (held here when prepared, evicted since)", registry=r)
        self.finished = Counter("tessera_decode_finished", "Sequences ended, by reason", ["reason"], registry=r)
        self.tokens = Counter("tessera_decode_tokens", "Tokens generated", registry=r)
        self.batch_size = Histogram("tessera_decode_batch_size", "Sequences per decode step", buckets=BATCH,
                                    registry=r)
        self.step_seconds = Histogram("tessera_decode_step_seconds", "One batched decode step, until its tokens are on "
                                      "the host", buckets=SECONDS,
                                      registry=r)
        self.admit_seconds = Histogram("tessera_decode_admit_seconds", "Rebuilding one hand-off's sequence (the batch "
                                       "waits meanwhile)", buckets=SECONDS, registry=r)
        self.active = Gauge("tessera_decode_active_sequences", "Sequences in the running batch", registry=r)
        self.sequence_steps = Counter("tessera_decode_sequence_steps", "Decode steps of ended sequences (one per "
                                      "sequence and step), by decode policy", ["policy"], registry=r)
        self.pages_visible = Counter("tessera_decode_pages_visible", "Pages (per KV head and layer) dense steps of "
                                     "ended sequences would have read, by decode policy", ["policy"], registry=r)
        self.pages_read = Counter("tessera_decode_pages_read", "Pages (per KV head and layer) the steps of ended "
                                  "sequences read, by decode policy", ["policy"], registry=r)
        self.pages_corrected = Counter("tessera_decode_pages_corrected", "Pages read for the current token and reused "
                                       "to correct past tokens' attention (retro), by decode policy", ["policy"],
                                       registry=r)
        self.keys_scanned = Counter("tessera_decode_keys_scanned", "Keys the retrieval index's searches scored for "
                                    "ended sequences (retrieval), by decode policy", ["policy"], registry=r)
        self.retrieval_seconds = Counter("tessera_decode_retrieval_seconds", "Time ended sequences' steps spent in "
                                         "the retrieval index's searches and their attention", ["policy"], registry=r)

    def count_reads(self, policy: str, stats: DecodeStats) -> None:
        """A sequence has ended: what its steps read, under its policy's name."""
        self.sequence_steps.labels(policy).inc(stats.steps)
        self.pages_visible.labels(policy).inc(stats.pages_visible)
        self.pages_read.labels(policy).inc(stats.pages_read)
        self.pages_corrected.labels(policy).inc(stats.pages_corrected)
        self.keys_scanned.labels(policy).inc(stats.keys_scanned)
        self.retrieval_seconds.labels(policy).inc(stats.retrieval_seconds)
