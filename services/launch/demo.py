"""``tessera demo``: bring the cluster up, replay a small Zipf trace in ``full`` then ``tessera``
mode through the SDK, print the two side by side, bring it down.

Everything is local and small enough for a 2-core CPU machine: a local Ray instance, the tiny
model written to a temporary directory, one store shard on a temporary RocksDB. The trace is
built in (``DEMO_TRACE``); each mode starts from cold caches.
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from services.cluster.config import ClusterConfig

# Rows of the replay report the demo prints (labels of loadgen.replay.report.summary_rows).
SHOWN = ("Successful requests", "Failed requests", "Output token throughput (tok/s)", "Total token throughput (tok/s)",
         "TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)", "E2EL p50 (ms)", "Chunk hit ratio (%)")


@dataclass(frozen=True, slots=True)
class DemoSettings:
    requests: int = 48
    docs: int = 16
    alpha: float = 1.1
    chunks_per_request: int = 4
    doc_tokens: int = 256
    suffix_tokens: int = 8
    output_tokens: int = 8
    concurrency: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.requests, self.docs, self.doc_tokens, self.suffix_tokens, self.output_tokens, self.concurrency) < 1:
            raise ValueError("demo sizes must all be >= 1")


def demo_trace(s: DemoSettings):
    from loadgen.trace import LengthDist, SynthConfig, synthesize

    return synthesize(SynthConfig(docs=s.docs, alpha=s.alpha, chunks_per_request=s.chunks_per_request,
                                  doc_tokens=LengthDist("const", (float(s.doc_tokens),)),
                                  suffix_tokens=LengthDist("const", (float(s.suffix_tokens),)),
                                  output_tokens=LengthDist("const", (float(s.output_tokens),)),
                                  rate=float("inf"), requests=s.requests, seed=s.seed))


def compact_table(summaries) -> str:
    from loadgen.replay.report import summary_rows

    rows = [(label, cells) for label, cells in summary_rows(summaries)
            if label in SHOWN or label.startswith(("  chunk tokens from", "p50 TTFT speed-up", "Throughput vs"))]
    width = max(len(label) for label, _ in rows)
    cols = [max(len(s.mode), *(len(c[i]) for _, c in rows)) for i, s in enumerate(summaries)]
    lines = [f"{'':<{width}}  " + "  ".join(f"{s.mode:>{w}}" for s, w in zip(summaries, cols))]
    lines += [f"{label:<{width}}  " + "  ".join(f"{c:>{w}}" for c, w in zip(cells, cols)) for label, cells in rows]
    return "\n".join(lines)


def run_demo(settings: DemoSettings, modes: tuple[str, ...] = ("full", "tessera"), output: str | None = None,
             say=print) -> int:
    from loadgen.replay import ReplayConfig, replay_modes
    from services.launch.on_ray import local_cluster
    from loadgen.replay.cluster_target import ClusterTarget
    from services.engine.model.tiny import write_tiny

    logging.getLogger("ray").setLevel(logging.WARNING)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tessera-demo-") as tmp:
        model = write_tiny(Path(tmp) / "tiny-llama")
        cfg = ClusterConfig(model_dir=str(model), store_dir=str(Path(tmp) / "rocksdb"), kv_cache_bytes=64 << 20)
        with local_cluster(cfg, progress=say) as cluster:
            say(f"cluster up in {time.perf_counter() - t0:.1f} s; gateway at {cluster.gateway_address}")
            target = ClusterTarget(cluster.gateway_address)
            trace = demo_trace(settings)
            say(f"replaying {len(trace)} requests ({settings.docs} docs, Zipf alpha {settings.alpha}, "
                f"{settings.chunks_per_request} x {settings.doc_tokens}-token chunks, {settings.output_tokens} output "
                f"tokens, {settings.concurrency} in flight) for: {', '.join(modes)}")
            rcfg = ReplayConfig(mode=modes[0], concurrency=settings.concurrency, vocab_size=target.vocab_size,
                                token_seed=settings.seed)
            runs, summaries = replay_modes(trace, target, rcfg, list(modes))
            target.close()
            say("")
            say(compact_table(summaries))
            if output:
                from loadgen.replay.report import write_report

                write_report(Path(output), runs, summaries, "tessera demo", "built-in demo trace, tiny model, CPU")
                say(f"full report under {output}")
            failed = sum(s.failed for s in summaries)
    say(f"demo finished in {time.perf_counter() - t0:.1f} s")
    return 1 if failed else 0
