"""The prefill worker's engine side: every call here runs on the worker's one engine thread.

Per chunk: a device cache hit, else a layer-by-layer stream from the KV store (the engine computes
layer i while layer i+1 arrives), else computed alone and written to the store in the background.
The first token is sampled here, as soon as the logits exist, and announced through ``on_first`` before
the hand-off is exported: the client gets it while the hand-off is still on its way to the decode worker.
The result is a hand-off: the request's private KV and its chunks' ids (``Engine.prefill_handoff``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import TYPE_CHECKING

from services.cluster.hostcache import layers_nbytes
from services.cluster.kvio import StoreAccess
from services.engine.sampling import SamplingParams
from services.prefill.controller import LoadingController
from services.prefill.metrics import PrefillMetrics
from services.tiers import Tier

if TYPE_CHECKING:
    from services.handoff.wire import Handoff

REUSE_MODES = ("tessera", "blend_copy")       # modes whose chunks are shared by content id (store-able)


@dataclass(frozen=True, slots=True)
class PrefillJob:
    request_id: str
    chunks: tuple[Sequence[int], ...]  # token ids: tuples, or a request message's repeated fields (read-only)
    suffix: Sequence[int]
    mode: str
    recompute_ratio: float | None      # None: the loading controller picks it
    sampling: SamplingParams
    enqueued: float = field(default_factory=time.perf_counter)
    namespaces: tuple[str, ...] = ()   # each chunk's namespace (a tenant's), () when all are plain
    tap_queries: bool = False          # the hand-off carries the pass's queries (a retrieval decode builds on them)


@dataclass(frozen=True, slots=True)
class PrefillOutcome:
    """What goes to the decode worker (``handoff``: services.engine.Handoff, serialised off the engine
    thread) and back to the gateway (the first token, stats). ``finish`` is "stop"/"length" when the
    first token ended the request: then no hand-off is needed."""

    handoff: Handoff | None           # None when the first token ended the request
    storing: tuple[str, ...]          # chunk ids queued for a store write by this request
    first_token: int
    finish: str | None
    first_token_seconds: float
    ratio: float
    tier_tokens: dict[Tier, int]
    recomputed_tokens: int
    loaded_bytes: int
    load_seconds: float
    load_wait_seconds: float
    chunk_compute_seconds: float
    forward_seconds: float
    prefill_seconds: float
    queue_seconds: float


class PrefillWorker:
    def __init__(self, engine, store: StoreAccess, controller: LoadingController, metrics: PrefillMetrics,
                 fixed_ratio: float | None = None) -> None:
        self.eng = engine
        self.store = store
        self.controller = controller
        self.metrics = metrics
        self.fixed_ratio = fixed_ratio
        self.kv_bytes_per_token = engine.describe_memory()["kv_bytes_per_token"]
        self.resident: tuple[str, ...] = ()   # snapshot for Status, which must not queue behind prefills
        # submissions waiting behind the request begun (the engine loop's queue; set by the servicer): the loading
        # controller keeps to its floor while any wait
        self.backlog: Callable[[], int] = lambda: 0

    def resident_ids(self) -> tuple[str, ...]:
        """Chunk ids in the device cache (engine thread); also refreshes the snapshot."""
        self.resident = tuple(k for k in self.eng.cache.keys() if "@" not in k)  # replicas are keyed id@start
        return self.resident

    def _tiers(self, job: PrefillJob, ids: list[str]) -> tuple[list[Tier], dict[str, Tier], set[str]]:
        """Where each chunk's KV will come from, decided before the pass (one engine thread: nothing
        changes the cache in between). Returns (tier per chunk, store lookup for the fetcher, ids the
        store holds: those computed instead of loaded need not be stored again)."""
        if job.mode == "full":
            return [Tier.COMPUTED] * len(ids), {}, set()
        if job.mode == "position_aware":
            starts, s = [], 0
            for c in job.chunks:
                starts.append(s)
                s += len(c)
            return [Tier.GPU if f"{cid}@{st}" in self.eng.cache else Tier.COMPUTED for cid, st in zip(ids, starts)], {}, set()
        if job.mode == "prefix":
            return [Tier.COMPUTED] * len(ids), {}, set()   # corrected from the engine's hit count afterwards
        missing = [cid for cid in ids if cid not in self.eng.cache]
        present = self.store.lookup(missing) if missing else {}
        held = set(present)
        if not self.controller.loads:
            present = {}            # the store path off: every chunk the GPU lacks is computed
        remote = [cid for cid, tier in present.items() if tier != Tier.HOST]
        if remote:
            # stream from the shards only what loads faster than it computes (one probe request in a few loads
            # anyway); the worker's own host tier always loads faster
            length = {cid: len(c) for cid, c in zip(ids, job.chunks)}
            tokens = sum(length[cid] for cid in remote)
            if not self.controller.prefer_load(tokens * self.kv_bytes_per_token, tokens):
                present = {cid: tier for cid, tier in present.items() if tier == Tier.HOST}
        seen: set[str] = set()
        tiers = []
        for cid in ids:
            if cid in self.eng.cache or cid in seen:
                tiers.append(Tier.GPU)
            else:
                tiers.append(present.get(cid, Tier.COMPUTED))
            seen.add(cid)
        return tiers, present, held

    def prefill(self, job: PrefillJob, on_first=None) -> PrefillOutcome:
        """Run one request; ``on_first(token)`` is called (engine thread) with the first token as soon as
        it is sampled."""
        return self.begin(job, on_first)()

    def begin(self, job: PrefillJob, on_first=None):
        """Issue one request's pass and return ``finish()`` -> PrefillOutcome, which waits for it,
        samples the first token (``on_first``), exports the hand-off and records the request. The engine
        thread may begin the next request before finishing this one: its host work then overlaps this
        pass on the device (``EngineLoop``)."""
        from services.engine.sampling import sample

        started = time.perf_counter()
        queue_s = started - job.enqueued
        # the request's ids read (and its chunk ids hashed) once: the pass takes the checked request
        req = self.eng.check(job.chunks, job.suffix, job.mode, extra_tokens=job.sampling.max_new_tokens,
                             namespaces=job.namespaces or None)
        ids = req.chunk_ids
        tiers, present, held = self._tiers(job, ids)
        storing: list[str] = []           # chunk ids this request queued for a store write

        def on_computed(chunk_id: str, layers) -> None:
            if chunk_id not in held and self._store_later(chunk_id, layers):
                storing.append(chunk_id)

        ratio = self._ratio(job, tiers)
        store = job.mode in REUSE_MODES and self.store.enabled
        first: list = []

        def on_logits(logits) -> None:
            params = job.sampling
            first.append(sample(logits, params, params.generator(logits.device)))
            first.append(time.perf_counter() - started)
            if on_first is not None:
                on_first(first[0])

        pending = self.eng.begin_prefill_handoff(
            req, None, mode=job.mode, recompute_ratio=ratio,
            fetch=self.store.fetcher(present, self.eng.device) if store else None,
            on_computed=on_computed if store else None,
            extra_tokens=job.sampling.max_new_tokens,
            kv_on_device=self.eng.device.type == "cuda",   # copied to the host (or shared) off this thread
            tap_queries=job.tap_queries)
        self.metrics.engine_seconds.inc(time.perf_counter() - started)

        def finish() -> PrefillOutcome:
            t0 = time.perf_counter()
            res, handoff = pending.finish(on_logits)
            out = self._record(job, res.stats, handoff, tiers, ratio, tuple(storing), first, started, queue_s)
            self.metrics.engine_seconds.inc(time.perf_counter() - t0)
            return out

        return finish

    def _record(self, job: PrefillJob, st, handoff, tiers: list[Tier], ratio: float, storing: tuple[str, ...],
                first: list, started: float, queue_s: float) -> PrefillOutcome:
        """A finished request's outcome, its tiers corrected from the pass's stats, and its metrics."""
        if job.mode == "prefix":
            tiers = [Tier.GPU if i < st.chunk_hits else Tier.COMPUTED for i in range(len(tiers))]
        if st.load_failures:
            # streams that broke were recomputed; count the latest store hits as computed
            bad = st.load_failures
            for i in reversed(range(len(tiers))):
                if bad and tiers[i] not in (Tier.GPU, Tier.COMPUTED):
                    tiers[i], bad = Tier.COMPUTED, bad - 1
        # the load speed it learns is the shards': a pass that also copied from the host tier says little of it
        self.controller.observe(st, loads=Tier.HOST not in tiers)
        tier_tokens: dict[Tier, int] = {}
        for tier, c in zip(tiers, job.chunks):
            tier_tokens[tier] = tier_tokens.get(tier, 0) + len(c)
            self.metrics.chunks.labels(tier).inc()
            self.metrics.chunk_tokens.labels(tier).inc(len(c))
        loaded = st.loaded_bytes
        wait = st.load_wait_seconds
        self.metrics.recomputed.inc(st.tokens_recomputed)
        self.metrics.loaded_bytes.inc(loaded)
        self.metrics.load_failures.inc(st.load_failures)
        self.metrics.load_wait.observe(wait)
        self.metrics.ratio.observe(ratio)
        seconds = time.perf_counter() - started
        self.metrics.seconds.observe(seconds)
        self.metrics.queue_seconds.observe(queue_s)
        return PrefillOutcome(handoff, storing, first[0], job.sampling.finish_reason(first[0], 1), first[1],
                              ratio, tier_tokens, st.tokens_recomputed, loaded, st.load_seconds, wait,
                              st.chunk_compute_seconds, st.forward_seconds, seconds, queue_s)

    def _ratio(self, job: PrefillJob, tiers: list[Tier]) -> float:
        if job.recompute_ratio is not None:
            return job.recompute_ratio
        if self.fixed_ratio is not None:
            return self.fixed_ratio
        store_tokens = sum(len(c) for t, c in zip(tiers, job.chunks) if t not in (Tier.GPU, Tier.COMPUTED, Tier.HOST))
        return self.controller.ratio(store_tokens * self.kv_bytes_per_token, sum(map(len, job.chunks)),
                                     waiting=self.backlog())

    def _store_later(self, chunk_id: str, layers) -> bool:
        if not self.store.put_later(chunk_id, layers, self.eng.fingerprint):
            return False
        self.metrics.stored_bytes.inc(layers_nbytes(layers))
        return True

    def warm(self, chunks: list[list[int]], namespaces: tuple[str, ...] = ()) -> list[bool]:
        """Compute each chunk alone (unless cached here or in the store) and store it; True when the
        store holds it afterwards. Pipelined: chunk i's store write (on the put thread) runs while chunk
        i+1 is computed; the answer waits for every write's acknowledgement. ``namespaces``: each chunk's
        (a tenant's), () when all are plain."""
        most_in_flight = 3      # writes queued at once: each holds a host copy of its chunk (64 MiB on Llama-3-8B)
        if namespaces and len(namespaces) != len(chunks):
            raise ValueError(f"{len(namespaces)} namespaces for {len(chunks)} chunks")
        namespaces = namespaces or ("",) * len(chunks)
        ids = [self.eng.chunk_id(c, ns) for c, ns in zip(chunks, namespaces)]
        held = set(self.store.lookup(ids, host=False)) if self.store.enabled else set()   # one round trip
        outcome: dict[str, object] = {}        # chunk id -> True/False, or the Future of its put
        in_flight: list = []
        for c, cid, ns in zip(chunks, ids, namespaces):
            if cid in outcome:
                continue
            if cid in held:
                outcome[cid] = True
                continue
            computed: list = []
            if cid not in self.eng.cache:
                # a chunk is computed alone whatever follows it: any one suffix token will do; its KV is
                # taken while the pass holds it (a device cache smaller than the chunk evicts it after)
                req = self.eng.check([c], [c[-1]], "tessera", namespaces=[ns] if ns else None)
                self.eng.prefill_handoff(req, None, mode="tessera", recompute_ratio=0.0,
                                         on_computed=lambda _cid, layers: computed.append(layers))
            outcome[cid] = False
            if self.store.enabled and (computed or cid in self.eng.cache):
                layers = computed[0] if computed else self.eng.export_chunk(cid)
                nbytes = layers_nbytes(layers)
                while len(in_flight) >= most_in_flight:
                    in_flight.pop(0).result()
                put = self.store.put_async(cid, layers, self.eng.fingerprint)
                put.add_done_callback(lambda f, n=nbytes: f.result() and self.metrics.stored_bytes.inc(n))
                outcome[cid] = put
                in_flight.append(put)
        return [o if isinstance(o, bool) else o.result() for o in (outcome[cid] for cid in ids)]

    def reset(self, device_only: bool = False, chunk_ids: tuple[str, ...] = ()) -> int:
        """Drop cached chunks: ``chunk_ids`` only (a tenant's), else every one; the store's copies too unless
        ``device_only``. Returns how many were dropped."""
        if chunk_ids:
            dropped = self.eng.cache.drop(chunk_ids)
            return dropped + (self.store.forget(chunk_ids, store=not device_only) if self.store.enabled else 0)
        before = len(self.eng.cache)
        self.eng.cache.clear()
        dropped = before - len(self.eng.cache)
        if self.store.enabled and not device_only:
            dropped += self.store.drop_known()
        return dropped
