"""Continuous batching: one engine thread admits new sequences between steps and decodes them all.

Each step: admit the hand-offs that arrived (rebuild the sequence, sample its first token from the
hand-off's logits, or take the one the prefill worker sampled and the client already has; with
``admit_budget_s``, for at most that much engine time while others are decoding, so that a burst of
arrivals does not stall every live sequence at once: off by default, see DecodeSettings), then one
``Engine.decode_step`` over every live sequence, sample each next token with that request's own
sampling parameters and generator (so a sequence's tokens do not depend on
which others share its batch), emit it, and retire finished sequences (their KV freed at once).
With ``min_step_interval_s`` (DecodeSettings) a step starts no sooner than that after the last one
began, admitting what arrives meanwhile. Stopping mirrors ``Engine.generate``: a stop token is
emitted, then the sequence ends.
Engine calls that are not decoding (reset, cache listing) run between steps through ``call``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from services.cluster.sampling import WireSampling
from services.decode.prepare import PreparedHandoff
from services.decode.metrics import DecodeMetrics

log = logging.getLogger(__name__)


@dataclass(slots=True)
class DecodeJob:
    """One request to decode. ``emit(tokens, finish_reason, error)`` is called from the engine thread:
    once per token, and last with a finish reason ("stop", "length") or an error message."""

    request_id: str
    handoff: PreparedHandoff | None     # None once admitted: its K/V are in the engine's pool then
    sampling: WireSampling
    emit: Callable[[list[int], str | None, str | None], None]
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass(slots=True)
class _Live:
    job: DecodeJob
    seq: object
    gen: object
    last: int
    produced: int


class Batcher:
    def __init__(self, engine, metrics: DecodeMetrics, max_batch: int, fetch=None,
                 admit_budget_s: float = float("inf"), profile=None, min_step_interval_s: float = 0.0) -> None:
        self.eng = engine
        self.metrics = metrics
        self.max_batch = max_batch
        self.admit_budget_s = admit_budget_s
        self.min_step_interval_s = min_step_interval_s   # DecodeSettings.min_step_interval_s
        self._last_step = float("-inf")
        self.fetch = fetch                    # fetch(chunk_id) for import_handoff, or None
        self.profile = profile                # services.cluster.profiling.ProfileWindow: ticks once a step
        self._inbox: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._live: list[_Live] = []
        self.resident: tuple[str, ...] = ()   # chunk ids in the device cache, refreshed by the engine thread
        self._thread = threading.Thread(target=self._run, name="decode-engine", daemon=True)
        self._thread.start()

    @property
    def active(self) -> int:
        return len(self._live)

    def submit(self, job: DecodeJob) -> None:
        self._inbox.put(job)

    def call(self, fn: Callable[[], object]) -> Future:
        """Run ``fn`` on the engine thread between steps."""
        fut: Future = Future()
        self._inbox.put((fn, fut))
        return fut

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(10)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        import torch

        with torch.no_grad():  # not inference_mode: kernels cache packed tables by tensor version
            while not self._stop.is_set():
                self._admit(block=not self._live)
                if self._live:
                    if self.min_step_interval_s:
                        self._pace()
                    self._last_step = time.perf_counter()
                    self._step()

    def _pace(self) -> None:
        """Until ``min_step_interval_s`` has passed since the last step began (or the batch is full),
        admit the hand-offs that arrive meanwhile."""
        while len(self._live) < self.max_batch and not self._stop.is_set():
            left = self._last_step + self.min_step_interval_s - time.perf_counter()
            if left <= 0:
                return
            self._admit(block=True, timeout=left)

    def _admit(self, block: bool, timeout: float = 0.5) -> None:
        """Take what the inbox holds, waiting up to ``timeout`` for a first item when ``block``."""
        t0 = time.perf_counter()
        admitted = 0
        while len(self._live) < self.max_batch:
            if admitted and self._live and time.perf_counter() - t0 >= self.admit_budget_s:
                return  # the rest waits for the next step: the live sequences have waited long enough
            try:
                item = self._inbox.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                return
            block = False
            if item is None:
                return
            if isinstance(item, tuple):
                fn, fut = item
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(exc)
            else:
                self._start(item)
                admitted += 1
            # the cache only changes here (imports, resets): keep the snapshot Status reads fresh
            self.resident = tuple(k for k in self.eng.cache.keys() if "@" not in k)

    def _start(self, job: DecodeJob) -> None:
        from services.engine.block_table import host_to_device
        from services.engine.sampling import sample

        t0 = time.perf_counter()
        try:
            seq, logits = self._rebuild(job.handoff)
        except Exception as exc:  # noqa: BLE001 - the request fails, the worker goes on
            log.warning("decode %s: cannot rebuild the sequence: %s", job.request_id, exc)
            job.emit([], None, f"{type(exc).__name__}: {exc}")
            return
        self.metrics.admit_seconds.observe(time.perf_counter() - t0)
        params = job.sampling.params
        gen = params.generator(self.eng.device)
        header = job.handoff.received.header
        job.handoff = None           # the sequence holds what it needs: the received K/V can go now
        sent = header.HasField("first_token")
        token = header.first_token if sent else None
        if not sent or gen is not None:
            # drawn even when the prefill worker sent it: a seeded generator must advance as the prefill's
            # did (a greedy pick draws nothing, and the one sent is taken as it is: no wait on the GPU)
            drawn = sample(host_to_device(logits, logits.dtype, self.eng.device), params, gen)
            if not sent:
                token = drawn
        live = _Live(job, seq, gen, token, 1)
        self.metrics.admitted.inc()
        if sent:                     # the client has it: decode goes on from it
            self._live.append(live)
        elif not self._emit(live):
            self._live.append(live)

    def _rebuild(self, prepared: PreparedHandoff):
        """(sequence, first-token logits) from a hand-off."""
        prepared.adopt()
        def fetch(cid: str):
            if cid in prepared.fetched:
                return iter(prepared.fetched[cid])
            return self.fetch(cid) if self.fetch is not None else None

        return self.eng.import_handoff(prepared.handoff, fetch=fetch), prepared.handoff.logits

    def _emit(self, live: _Live) -> bool:
        """Send the newest token; True (and the sequence released) when the request is over."""
        job = live.job
        if job.cancelled.is_set():
            self._finish(live, None, "cancelled")
            return True
        reason = job.sampling.finish_reason(live.last, live.produced)
        job.emit([live.last], None, None)
        self.metrics.tokens.inc()
        if reason is not None:
            self._finish(live, reason, None)
            return True
        return False

    def _finish(self, live: _Live, reason: str | None, error: str | None) -> None:
        self.eng.release(live.seq)
        if error != "cancelled":
            live.job.emit([], reason, error)
        self.metrics.finished.labels(reason or error or "error").inc()

    def _step(self) -> None:
        from services.engine.sampling import sample

        batch = self._live
        if self.profile is not None:
            self.profile.tick()
        self.metrics.batch_size.observe(len(batch))
        t0 = time.perf_counter()
        try:
            logits = self.eng.decode_step([lv.seq for lv in batch], [lv.last for lv in batch])  # [B, vocab]
        except Exception as exc:  # noqa: BLE001 - e.g. KV memory exhausted: fail this batch, keep serving
            log.warning("decode step over %d sequences failed: %s", len(batch), exc)
            for lv in batch:
                self._finish(lv, None, f"decode step failed: {type(exc).__name__}: {exc}")
            self._live = []
            return
        # greedy rows: one argmax over the batch and one copy to the host, not a sync per sequence
        greedy = [i for i, lv in enumerate(batch) if lv.job.sampling.params.temperature == 0]
        picked = dict(zip(greedy, logits[greedy].argmax(dim=-1).tolist())) if greedy else {}
        for i, lv in enumerate(batch):
            lv.last = picked[i] if i in picked else sample(logits[i], lv.job.sampling.params, lv.gen)
            lv.produced += 1
        # the step ends when its tokens are on the host: decode_step only issues the GPU's work, so timing
        # it alone measured the launch, not the step (the token read-back above is the wait for the GPU)
        self.metrics.step_seconds.observe(time.perf_counter() - t0)
        keep = []
        for lv in batch:
            if not self._emit(lv):
                keep.append(lv)
        self._live = keep
        self.metrics.active.set(len(keep))
