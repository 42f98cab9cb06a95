"""Continuous batching: one engine thread admits new sequences between steps and decodes them all.

Each step: admit the hand-offs that arrived (rebuild the sequence, sample its first token from the
hand-off's logits, or take the one the prefill worker sampled and the client already has; with
``admit_budget_s``, for at most that much engine time while others are decoding, so that a burst of
arrivals does not stall every live sequence at once: off by default, see DecodeSettings), then one
``Engine.decode_step`` over every live sequence, sample each next token with that request's own
sampling parameters and generator (so a sequence's tokens do not depend on
which others share its batch), emit it, and retire finished sequences (their KV freed at once).
With ``min_step_interval_s`` (DecodeSettings) a step starts no sooner than that after the last one
began, admitting what arrives meanwhile. With ``admit_during_step`` the hand-offs that arrived are also admitted
while a step runs: after ``decode_step`` has issued it and before its tokens are read back, so that their host work
overlaps its device work (they join the next step). Stopping mirrors ``Engine.generate``: a stop token is
emitted, then the sequence ends.
Engine calls that are not decoding (reset, cache listing) run between steps through ``call``. A hand-off whose
import would read shared chunks from the store on this thread (resident when it was prepared, evicted since) goes
back to a helper that reads them (``restage``, at most ``MAX_RESTAGES`` times) and comes back through the inbox.

No request stops the thread: a failure fails the requests it concerns (one sequence's sampling, one
hand-off's rebuild, or the step's batch), each with a ``RequestError`` (the caller sees an id, never a
Python exception's text), and the loop goes on. The retrieval index service failing (``IndexUnavailable``,
services/decode/indexes.py: a sequence's offload, or a step's search) fails those requests saying so and is
not counted as the engine failing. Only when ``MAX_FAILED_STEPS`` iterations fail in a row
(the device itself is broken: a sticky CUDA error) or something escapes the loop does it stop for good:
every waiting job is failed, ``alive`` turns False and ``on_fatal`` is called (the server reports
NOT_SERVING and the process exits, so Ray restarts the worker).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from services.cluster.errors import RequestError, internal
from services.engine.spans import span
from services.decode.indexes import IndexUnavailable
from services.engine.decode import DENSE, DecodePolicy, DecodeStats
from services.engine.sampling import SamplingParams
from services.handoff.prepare import PreparedHandoff
from services.decode.metrics import DecodeMetrics

if TYPE_CHECKING:
    import torch

    from services.engine.request import Sequence

log = logging.getLogger(__name__)
MAX_FAILED_STEPS = 3     # loop iterations failing in a row before the engine is taken for broken
WAIT_READY_S = 0.005       # a step with every live sequence still preparing waits this long for arrivals
# NOTE: a hand-off whose shared chunks were held here when it was prepared and evicted before its admission (the
# batch's chunks past the cache: a batch of 16 of 6 chunks of an 8B model needs 6 GiB) is sent back this many times
# to have them read off this thread (``restage``); past that its import reads them here. Read here, each cost a store
# lookup and a device read this thread waited for (a profile of four H200s' decode workers: bench/cluster/README.md)
MAX_RESTAGES = 2


@dataclass(slots=True)
class DecodeJob:
    """One request to decode. ``emit(tokens, finish_reason, error)`` is called from the engine thread:
    once per token, and last with a finish reason ("stop", "length") or a ``RequestError``; ``stats`` is set
    before that last call."""

    request_id: str
    handoff: PreparedHandoff | None     # None once admitted: its K/V are in the engine's pool then
    sampling: SamplingParams
    emit: Callable[[list[int], str | None, RequestError | None], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    policy: DecodePolicy = DENSE        # how its steps attend (services/engine/decode); sequences of any mix batch
    stats: DecodeStats | None = None    # what its steps read: a copy taken as its sequence is released
    restaged: int = 0                   # times sent back at admission to have chunks read (``Batcher.restage``)


@dataclass(slots=True)
class _Live:
    job: DecodeJob
    seq: Sequence
    gen: torch.Generator | None       # None: greedy
    last: int
    produced: int


class Batcher:
    def __init__(self, engine, metrics: DecodeMetrics, max_batch: int, fetch=None,
                 admit_budget_s: float = float("inf"), profile=None, min_step_interval_s: float = 0.0,
                 on_fatal: Callable[[BaseException], None] | None = None, name: str = "decode worker",
                 admit_during_step: bool = False,
                 restage: Callable[[DecodeJob, list[str]], None] | None = None) -> None:
        self.eng = engine
        self.metrics = metrics
        self.max_batch = max_batch
        self.admit_budget_s = admit_budget_s
        self.min_step_interval_s = min_step_interval_s   # DecodeSettings.min_step_interval_s
        self.admit_during_step = admit_during_step       # DecodeSettings.admit_during_step
        self._window = (0, 0.0)   # (hand-offs admitted, seconds) while the last step ran: the next _admit's budget
        self._last_step = float("-inf")
        self.fetch = fetch                    # fetch(chunk_id) for import_handoff, or None
        # restage(job, chunk ids): a helper reads the chunks a hand-off's import would otherwise read from the store on
        # this thread (evicted here since it was prepared), then submits the job again; None: the import reads them
        self.restage = restage
        self.profile = profile                # services.cluster.profiling.ProfileWindow: ticks once a step
        self._inbox: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._live: list[_Live] = []
        self.resident: tuple[str, ...] = ()   # chunk ids in the device cache, refreshed by the engine thread
        self.on_fatal = on_fatal              # called once, from the engine thread, when it stops for good
        self.name = name                      # in the errors callers see
        self.failure: BaseException | None = None   # why the thread stopped for good
        # set (under the lock) once the thread has stopped for good: what a job submitted after is failed with
        self._closing = threading.Lock()
        self._closed: RequestError | None = None
        self._thread = threading.Thread(target=self._run, name="decode-engine", daemon=True)
        self._thread.start()

    @property
    def active(self) -> int:
        return len(self._live)

    @property
    def alive(self) -> bool:
        """Whether the engine thread still serves (health reports this, not the process's liveness)."""
        return self._thread.is_alive() and self.failure is None

    def submit(self, job: DecodeJob) -> None:
        """Queue a hand-off for the engine thread; once that thread has stopped for good, fail it at once (it would
        wait for nobody)."""
        self._put(job)

    def call(self, fn: Callable[[], object]) -> Future:
        """Run ``fn`` on the engine thread between steps."""
        fut: Future = Future()
        self._put((fn, fut))
        return fut

    def _put(self, item) -> None:
        with self._closing:
            if self._closed is None:
                self._inbox.put(item)
                return
            err = self._closed
        _refuse(item, err)

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(10)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        import torch

        failed = 0
        try:
            with torch.no_grad():  # not inference_mode: kernels cache packed tables by tensor version
                while not self._stop.is_set():
                    try:
                        self._iterate()
                        failed = 0
                    except Exception as exc:  # noqa: BLE001 - fail what the iteration held, keep serving
                        failed += 1
                        err = internal(f"{self.name}'s engine loop", exc)
                        for lv in self._live:
                            self._finish(lv, None, err)
                        self._live = []
                        if failed >= MAX_FAILED_STEPS:
                            raise RuntimeError(f"{failed} engine loop iterations failed in a row") from exc
        except BaseException as exc:  # noqa: BLE001 - the loop is over: say so, and let the worker restart
            self.failure = exc
            log.critical("%s: the engine loop stopped for good: %s", self.name, exc, exc_info=exc)
            self._fail_all(internal(f"{self.name}'s engine loop", exc))
            if self.on_fatal is not None:
                self.on_fatal(exc)

    def _iterate(self) -> None:
        spent, self._window = self._window, (0, 0.0)
        self._admit(block=not self._live, spent=spent)
        if self._live:
            if self.min_step_interval_s:
                self._pace()
            self._last_step = time.perf_counter()
            self._step()

    def _fail_all(self, err: RequestError) -> None:
        """Fail every live and waiting job (the loop is stopping for good), and every job submitted from now on."""
        for lv in self._live:
            _quietly(lv.job.emit, [], None, err)
        self._live = []
        with self._closing:
            self._closed = err
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                _refuse(item, err)

    def _pace(self) -> None:
        """Until ``min_step_interval_s`` has passed since the last step began (or the batch is full),
        admit the hand-offs that arrive meanwhile."""
        while len(self._live) < self.max_batch and not self._stop.is_set():
            left = self._last_step + self.min_step_interval_s - time.perf_counter()
            if left <= 0:
                return
            self._admit(block=True, timeout=left)

    def _admit(self, block: bool, timeout: float = 0.5, spent: tuple[int, float] = (0, 0.0)) -> None:
        """Take what the inbox holds, waiting up to ``timeout`` for a first item when ``block``. ``spent``: hand-offs
        admitted, and the seconds it took, while the last step ran (``_admit_during_step``): they count against
        ``admit_budget_s`` as if admitted here."""
        t0 = time.perf_counter() - spent[1]
        admitted = spent[0]
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
            self._refresh_resident()

    def _refresh_resident(self) -> None:
        """The cache only changes at admissions and engine calls (imports, resets): keep the snapshot Status reads
        fresh."""
        self.resident = tuple(k for k in self.eng.cache.keys() if "@" not in k)

    def _admit_during_step(self) -> None:
        """Hand-offs admitted while a step runs on the GPU (issued, its tokens not yet read back), so that an
        admission's host work overlaps the step's device work rather than adding to it: the imports' own device work
        queues behind the step on the engine's stream. The new sequences join ``_live`` (not the running step's
        batch). Stops at anything that is not a hand-off (an engine call or the stop: they run between steps, in their
        turn), at ``max_batch``, and at ``admit_budget_s`` (what it spends counts against the next ``_admit``)."""
        t0 = time.perf_counter()
        admitted = 0
        while len(self._live) < self.max_batch:
            if admitted and time.perf_counter() - t0 >= self.admit_budget_s:
                break
            inbox = self._inbox
            with inbox.mutex:       # a peek: an engine call or the stop is left where it is, first in line
                if not inbox.queue or not isinstance(inbox.queue[0], DecodeJob):
                    break
            try:
                item = inbox.get_nowait()
            except queue.Empty:
                break
            self._start(item)
            admitted += 1
        if admitted:
            self._refresh_resident()
        self._window = (admitted, time.perf_counter() - t0)

    def _start(self, job: DecodeJob) -> None:
        """Admit ``job``: its sequence rebuilt and its first token taken or sampled; appended to ``_live`` unless it
        ended at once (or failed: its caller is told)."""
        from services.engine.kv.block_table import host_to_device
        from services.engine.sampling import sample

        from services.engine.kv.block_pool import PoolExhausted

        if self.restage is not None and job.restaged < MAX_RESTAGES:
            unstaged = job.handoff.unstaged(self.eng.cache)
            if unstaged:
                job.restaged += 1
                try:
                    self.restage(job, unstaged)
                except Exception as exc:  # noqa: BLE001 - its helpers are gone (the worker stopping): read here
                    log.warning("%s: request %s could not go back to be staged (%s); its chunks are read here",
                                self.name, job.request_id, exc)
                else:
                    self.metrics.restaged.inc()
                    return
        t0 = time.perf_counter()
        try:
            with span("tessera.admit"):   # a named span in a TESSERA_TORCH_PROFILE trace
                seq, logits = self._rebuild(job.handoff, job.policy)
        except PoolExhausted as exc:
            _quietly(job.emit, [], None, RequestError("exhausted", f"{self.name}: no KV memory for the "
                                                                   f"sequence now: {exc}"))
            return
        except Exception as exc:  # noqa: BLE001 - the request fails, the worker goes on
            _quietly(job.emit, [], None, internal(f"{self.name} rebuilding request {job.request_id}", exc))
            return
        self.metrics.admit_seconds.observe(time.perf_counter() - t0)
        params = job.sampling
        header = job.handoff.received.header
        job.handoff = None           # the sequence holds what it needs: the received K/V can go now
        sent = header.HasField("first_token")
        token = header.first_token if sent else None
        try:
            gen = params.generator(self.eng.device)
            if not sent or gen is not None:
                # drawn even when the prefill worker sent it: a seeded generator must advance as the prefill's
                # did (a greedy pick draws nothing, and the one sent is taken as it is: no wait on the GPU)
                drawn = sample(host_to_device(logits, logits.dtype, self.eng.device), params, gen)
                if not sent:
                    token = drawn
        except Exception as exc:  # noqa: BLE001 - this request fails, the worker goes on
            self.eng.release(seq)
            _quietly(job.emit, [], None, internal(f"{self.name} sampling request {job.request_id}", exc))
            return
        live = _Live(job, seq, gen, token, 1)
        self.metrics.admitted.inc()
        if sent:                     # the client has it: decode goes on from it
            self._live.append(live)
        elif not self._emit(live):
            self._live.append(live)

    def _rebuild(self, prepared: PreparedHandoff, policy: DecodePolicy = DENSE):
        """(sequence, first-token logits) from a hand-off; the sequence's steps attend by ``policy``."""
        prepared.adopt()
        for cid, (blob, length) in prepared.chunk_indexes.items():
            self.eng.adopt_chunk_index(cid, blob, length)
        def fetch(cid: str):
            if cid in prepared.fetched:
                return iter(prepared.fetched[cid])
            return self.fetch(cid) if self.fetch is not None else None

        seq = self.eng.import_handoff(prepared.handoff, fetch=fetch, decode=policy, layout=prepared.layout)
        return seq, prepared.handoff.logits

    def _emit(self, live: _Live) -> bool:
        """Send the newest token; True (and the sequence released) when the request is over."""
        job = live.job
        if job.cancelled.is_set():
            self._finish(live, None, "cancelled")
            return True
        reason = job.sampling.finish_reason(live.last, live.produced)
        if not _quietly(job.emit, [live.last], None, None):     # its caller is gone
            self._finish(live, None, "cancelled")
            return True
        self.metrics.tokens.inc()
        if reason is not None:
            self._finish(live, reason, None)
            return True
        return False

    def _finish(self, live: _Live, reason: str | None, error: RequestError | str | None) -> None:
        """Release the sequence and tell its caller how it ended (``error`` "cancelled": the caller left). What its
        steps read is taken first (the engine keeps it until the release) and counted under its policy."""
        job = live.job
        job.stats = replace(live.seq.decode_stats)
        self.metrics.count_reads(job.policy.name, job.stats)
        try:
            self.eng.release(live.seq)
        finally:
            if error != "cancelled":
                _quietly(live.job.emit, [], reason, error)
            label = reason or (error if isinstance(error, str) else error.kind if error is not None else "error")
            self.metrics.finished.labels(label).inc()

    def _step(self) -> None:
        from services.engine.sampling import sample

        batch, waiting = [], []
        for lv in self._live:   # a sequence still preparing (a retrieval index building) sits this step out
            try:
                (batch if lv.seq.decode.ready(lv.seq) else waiting).append(lv)
            except IndexUnavailable as exc:   # its offload to the index service failed
                self._finish(lv, None, RequestError("internal", f"{self.name}, request {lv.job.request_id}: {exc}"))
            except Exception as exc:  # noqa: BLE001 - its preparation failed: it fails, the batch goes on
                self._finish(lv, None, internal(f"{self.name} preparing request {lv.job.request_id}", exc))
        if not batch:
            self._live = waiting
            self._admit(block=True, timeout=WAIT_READY_S)   # what arrives meanwhile, or a short wait
            return
        if self.profile is not None:
            self.profile.tick()
        self.metrics.batch_size.observe(len(batch))
        t0 = time.perf_counter()
        from services.engine.kv.block_pool import PoolExhausted

        try:
            with span("tessera.step"):
                logits = self.eng.decode_step([lv.seq for lv in batch], [lv.last for lv in batch])  # [B, vocab]
        except PoolExhausted as exc:     # KV memory exhausted: fail this batch, keep serving
            log.warning("decode step over %d sequences failed: %s", len(batch), exc)
            err = RequestError("exhausted", f"{self.name}: KV memory ran out during a decode step")
            for lv in batch:
                self._finish(lv, None, err)
            self._live = waiting
            return
        except IndexUnavailable as exc:  # a search failed: the batch fails (its K/V half written), not the worker
            log.warning("decode step over %d sequences failed: %s", len(batch), exc)
            err = RequestError("internal", f"{self.name}: a decode step failed: {exc}")
            for lv in batch:
                self._finish(lv, None, err)
            self._live = waiting
            return
        # decode_step only issued the step's device work: what has arrived is admitted now, beside it (into _live at
        # once, so that a failure from here on fails them with the rest)
        held = len(self._live)
        if self.admit_during_step:
            self._admit_during_step()
        arrived = self._live[held:]
        # greedy rows: one argmax over the batch and one copy to the host, not a sync per sequence
        greedy = [i for i, lv in enumerate(batch) if lv.job.sampling.temperature == 0]
        picked = dict(zip(greedy, logits[greedy].argmax(dim=-1).tolist())) if greedy else {}
        failed: dict[int, RequestError] = {}
        for i, lv in enumerate(batch):
            try:
                lv.last = picked[i] if i in picked else sample(logits[i], lv.job.sampling, lv.gen)
            except Exception as exc:  # noqa: BLE001 - this sequence fails, the batch goes on
                failed[i] = internal(f"{self.name} sampling request {lv.job.request_id}", exc)
            lv.produced += 1
        # the step ends when its tokens are on the host: decode_step only issues the GPU's work, so timing
        # it alone measured the launch, not the step (the token read-back above is the wait for the GPU). With
        # admit_during_step this includes the admissions made meanwhile (admit_seconds counts them too)
        self.metrics.step_seconds.observe(time.perf_counter() - t0)
        keep = []
        for i, lv in enumerate(batch):
            if i in failed:
                self._finish(lv, None, failed[i])
            elif not self._emit(lv):
                keep.append(lv)
        self._live = keep + waiting + arrived
        self.metrics.active.set(len(keep) + len(arrived))


def _refuse(item, err: RequestError) -> None:
    """An inbox item the engine thread will never take: an engine call's future or a hand-off, failed with ``err``."""
    if isinstance(item, tuple):
        item[1].set_exception(RuntimeError(err.message))
    else:
        _quietly(item.emit, [], None, err)


def _quietly(emit, tokens, reason, error) -> bool:
    """``emit(...)``; False when the caller cannot be told any more (its event loop closed)."""
    try:
        emit(tokens, reason, error)
        return True
    except RuntimeError:
        return False
