"""The load generator's replay target for a running cluster, reached through the SDK only (services.sdk).

``ClusterTarget(address)`` is what ``loadgen.replay`` drives: ``generate(ReplayRequest)`` streams
``StreamEvent``s (tokens as they arrive, per-tier chunk tokens on the last), ``reset()`` drops
every cached chunk so each mode of a comparison starts cold, ``vocab_size`` comes from Stats.
"""

from __future__ import annotations

from collections.abc import Iterator

from loadgen.replay.target import ReplayRequest, RequestStats, StreamEvent
from services.sdk import Client


def stage_seconds(st) -> dict[str, float]:
    """Where one request's time went inside the cluster (GenerationStats), by serving stage."""
    stages = {"queue": st.queue_seconds, "prefill": st.prefill_seconds, "first token": st.first_token_seconds,
              "chunk compute": st.chunk_compute_seconds, "forward": st.forward_seconds,
              "store wait": st.load_wait_seconds}
    if st.handoff_bytes:
        stages["hand-off"] = st.handoff_seconds
    return stages


class ClusterTarget:
    def __init__(self, address: str, token: str | None = None, timeout: float = 300.0) -> None:
        self.client = Client(address, token=token, timeout=timeout)

    @property
    def vocab_size(self) -> int:
        return self.client.stats().vocab_size

    def generate(self, request: ReplayRequest) -> Iterator[StreamEvent]:
        # stop_token_ids=[]: no EOS stop, so every request yields exactly its trace output length
        for ev in self.client.generate(chunks=[list(c) for c in request.chunks], suffix=list(request.suffix),
                                       max_new_tokens=request.max_tokens, mode=request.mode, stop_token_ids=[]):
            stats = None
            if ev.stats is not None:
                st = ev.stats
                stats = RequestStats(tier_tokens=dict(st.chunk_tokens_by_tier), recomputed_tokens=st.recomputed_tokens,
                                     stage_s=stage_seconds(st))
            yield StreamEvent(token_ids=ev.token_ids, stats=stats)

    def reset(self) -> None:
        self.client.reset_caches()

    def close(self) -> None:
        self.client.close()
