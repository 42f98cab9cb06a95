"""The decode batcher's admission between steps, against a stand-in engine (no model): with a zero
admission budget a burst of hand-offs is spread over steps, one per step while others decode; with an
unbounded one (the default) it is taken between two steps."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from services.cluster.config import DecodeSettings
from services.decode.batcher import Batcher, DecodeJob
from services.decode.metrics import DecodeMetrics
from services.engine.decode import DENSE, DecodePolicy, DecodeStats, QuestDecode, RetroDecode
from services.engine.sampling import SamplingParams

VOCAB = 8


class StandInEngine:
    """Logs the batcher's engine calls: ("import", request) and ("step", batch size)."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.log: list[tuple[str, object]] = []
        self.cache = SimpleNamespace(keys=lambda: [])
        self.step_gate = threading.Event()   # steps wait for it: the test decides when decoding starts

    def import_handoff(self, handoff, fetch=None, decode="dense", layout=None):
        self.log.append(("import", handoff.request_id))
        return SimpleNamespace(request_id=handoff.request_id, decode=decode, decode_stats=DecodeStats())

    def decode_step(self, seqs, tokens):
        assert self.step_gate.wait(10)
        self.log.append(("step", len(seqs)))
        return torch.zeros(len(seqs), VOCAB)

    def release(self, seq) -> None:
        pass


def _job(rid: str, tokens: int, done: threading.Event) -> DecodeJob:
    handoff = SimpleNamespace(request_id=rid, logits=torch.zeros(VOCAB))
    header = SimpleNamespace(HasField=lambda name: False)
    prepared = SimpleNamespace(adopt=lambda: None, handoff=handoff, fetched={}, chunk_indexes={}, layout=None,
                               received=SimpleNamespace(header=header))
    sampling = SamplingParams(0.0, 1.0, 0, None, tokens)

    def emit(new, reason, error):
        assert error is None
        if reason is not None:
            done.set()
    return DecodeJob(rid, prepared, sampling, emit)


def _run(budget: float, burst: int = 4, eng: StandInEngine | None = None, **batcher) -> list[tuple[str, object]]:
    """A first sequence goes live, ``burst`` hand-offs arrive while its first step waits at the gate, then every
    request runs to its end; the engine's log. ``batcher``: more Batcher arguments (max_batch 8 unless given)."""
    eng = eng if eng is not None else StandInEngine()
    batcher = Batcher(eng, DecodeMetrics(), admit_budget_s=budget, **{"max_batch": 8, **batcher})
    done = [threading.Event() for _ in range(burst + 1)]
    try:
        batcher.submit(_job("first", 40, done[0]))
        for _ in range(1000):                   # bounded: the first sequence is live, its first step waiting
            if batcher.active == 1:
                break
            threading.Event().wait(0.005)
        assert batcher.active == 1
        for i in range(burst):                  # a burst arrives while a step is pending
            batcher.submit(_job(f"burst{i}", 6, done[i + 1]))
        eng.step_gate.set()
        assert all(d.wait(10) for d in done)
    finally:
        batcher.stop()
    return eng.log


def test_zero_budget_admits_one_hand_off_per_step_while_others_decode():
    log = _run(0.0)
    kinds = [k for k, _ in log]
    first_step = kinds.index("step")
    # after decoding has started, never two imports between two steps
    assert all(not (a == b == "import") for a, b in zip(kinds[first_step:], kinds[first_step + 1:]))
    assert kinds.count("import") == 5
    assert max(n for k, n in log if k == "step") >= 2    # the burst did join the batch


def test_unbounded_budget_takes_a_burst_between_two_steps():
    log = _run(3600.0)
    kinds = [k for k, _ in log]
    first_step = kinds.index("step")
    # the burst was queued before the first step returned: it is admitted in one go right after it
    assert kinds[first_step + 1:first_step + 5] == ["import"] * 4


def test_admit_budget_is_validated():
    with pytest.raises(ValueError, match="admit_budget_s"):
        DecodeSettings(admit_budget_s=-1)


@pytest.mark.slow
def test_paced_steps_start_no_sooner_than_the_interval_and_admit_what_arrives_meanwhile():
    import time

    eng = StandInEngine()
    starts: list[float] = []
    step = eng.decode_step

    def timed_step(seqs, tokens):
        starts.append(time.perf_counter())
        return step(seqs, tokens)

    eng.decode_step = timed_step
    eng.step_gate.set()
    interval = 0.3
    batcher = Batcher(eng, DecodeMetrics(), max_batch=8, min_step_interval_s=interval)
    done = [threading.Event() for _ in range(2)]
    try:
        batcher.submit(_job("first", 4, done[0]))
        for _ in range(1000):                   # bounded: wait for the first step
            if starts:
                break
            threading.Event().wait(0.005)
        batcher.submit(_job("second", 2, done[1]))   # arrives while the batcher waits out the interval
        assert all(d.wait(10) for d in done)
    finally:
        batcher.stop()
    assert all(b - a >= interval for a, b in zip(starts, starts[1:]))
    steps = [n for k, n in eng.log if k == "step"]
    # the second hand-off joined the very next step instead of waiting a step of its own
    assert steps[:2] == [1, 2] and eng.log.index(("import", "second")) < [i for i, e in enumerate(eng.log)
                                                                         if e[0] == "step"][1]


def test_step_interval_is_validated():
    for bad in (-0.1, 10.0):
        with pytest.raises(ValueError, match="min_step_interval_s"):
            DecodeSettings(min_step_interval_s=bad)


def test_an_admitted_job_lets_its_hand_off_go():
    """Once imported, the hand-off's K/V live in the engine's pool: the job (held until the request ends, and by
    whoever else kept it) no longer holds the received tensors."""
    eng = StandInEngine()
    eng.step_gate.set()
    batcher = Batcher(eng, DecodeMetrics(), max_batch=8)
    done = threading.Event()
    job = _job("one", 3, done)
    try:
        batcher.submit(job)
        assert done.wait(10)
    finally:
        batcher.stop()
    assert ("import", "one") in eng.log and job.handoff is None


class _Pending:
    """Logits whose values are not there yet: reading the picked tokens back waits ``wait_s`` (the GPU
    finishing the step), as a real step's token read-back does."""

    def __init__(self, rows: int, wait_s: float):
        self.rows, self.wait_s = rows, wait_s

    def __getitem__(self, index):
        return self

    def argmax(self, dim):
        return self

    def tolist(self):
        threading.Event().wait(self.wait_s)
        return [0] * self.rows


def test_the_step_metric_lasts_until_the_tokens_are_on_the_host():
    wait_s = 0.05
    eng = StandInEngine()
    eng.step_gate.set()
    step = eng.decode_step
    eng.decode_step = lambda seqs, tokens: (step(seqs, tokens), _Pending(len(seqs), wait_s))[1]
    metrics = DecodeMetrics()
    batcher = Batcher(eng, metrics, max_batch=8)
    done = threading.Event()
    try:
        batcher.submit(_job("only", 4, done))
        assert done.wait(10)
    finally:
        batcher.stop()
    steps = [n for k, n in eng.log if k == "step"]
    count = metrics.registry.get_sample_value("tessera_decode_step_seconds_count")
    total = metrics.registry.get_sample_value("tessera_decode_step_seconds_sum")
    assert count == len(steps) == 3                  # 4 tokens: the first from the hand-off, then 3 steps
    assert total >= wait_s * count                   # each step's time includes its token read-back


def test_an_ending_sequence_reports_and_counts_what_its_steps_read():
    """A job's stats are its sequence's, taken before the release (the engine keeps them until then) and before its
    caller hears the end; the worker's counters add them under the policy's name."""
    eng = StandInEngine()
    eng.step_gate.set()
    step = eng.decode_step

    def reading_step(seqs, tokens):       # per step: 12 pages visible; quest reads 5, retro also corrects 2
        for s in seqs:
            sparse = s.decode is not DENSE
            s.decode_stats.add(12, 5 if sparse else 12, 2 if isinstance(s.decode, RetroDecode) else 0)
        return step(seqs, tokens)

    def release(seq):
        seq.decode_stats = DecodeStats()  # gone with the sequence

    eng.decode_step, eng.release = reading_step, release
    metrics = DecodeMetrics()
    batcher = Batcher(eng, metrics, max_batch=8)
    policies = {"d": DENSE, "q": QuestDecode(budget_tokens=32, dense_layers=1),
                "r": RetroDecode(budget_tokens=32, dense_layers=1, retro_window=3)}
    jobs, heard = {}, {}
    ended = threading.Event()

    def emit_for(rid):
        def emit(new, reason, error):
            if reason is not None:
                heard[rid] = jobs[rid].stats
                if len(heard) == len(policies):
                    ended.set()
        return emit

    try:
        for rid, policy in policies.items():       # 5 tokens: the first from the hand-off, then 4 steps
            jobs[rid] = DecodeJob(rid, _job(rid, 5, threading.Event()).handoff, SamplingParams(0.0, 1.0, 0, None, 5),
                                  emit_for(rid), policy=policy)
            batcher.submit(jobs[rid])
        assert ended.wait(10)
    finally:
        batcher.stop()
    assert heard["d"] == DecodeStats(4, 48, 48, 0) and heard["q"] == DecodeStats(4, 48, 20, 0)
    assert heard["r"] == DecodeStats(4, 48, 20, 8)
    value = metrics.registry.get_sample_value
    for name, (steps, visible, read, corrected) in {"dense": (4, 48, 48, 0), "quest": (4, 48, 20, 0),
                                                    "retro": (4, 48, 20, 8)}.items():
        labels = {"policy": name}
        assert value("tessera_decode_sequence_steps_total", labels) == steps
        assert value("tessera_decode_pages_visible_total", labels) == visible
        assert value("tessera_decode_pages_read_total", labels) == read
        assert value("tessera_decode_pages_corrected_total", labels) == corrected


def test_the_per_policy_counters_are_listed_in_the_readme():
    from pathlib import Path

    metrics = DecodeMetrics()
    metrics.count_reads("dense", DecodeStats())
    names = {s.name for family in metrics.registry.collect() for s in family.samples
             if "policy" in s.labels and s.name.endswith("_total")}
    assert len(names) == 6
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert [n for n in sorted(names) if f"`{n}`" not in readme] == []


class _Preparing(DecodePolicy):
    """A policy that prepares in the background (as retrieval builds its indexes): ready once ``gate`` is set, or
    raising ``error`` when given."""

    name = "preparing"

    def __init__(self, gate: threading.Event, error: Exception | None = None):
        self.gate, self.error = gate, error

    def ready(self, seq) -> bool:
        if self.error is not None:
            raise self.error
        return self.gate.is_set()


def test_a_sequence_still_preparing_sits_steps_out_while_the_others_decode():
    eng = StandInEngine()
    eng.step_gate.set()
    batcher = Batcher(eng, DecodeMetrics(), max_batch=8)
    gate, slow_done, fast_done, failed_done = threading.Event(), threading.Event(), threading.Event(), threading.Event()
    errors = []

    def failing_emit(new, reason, error):
        errors.append(error)
        failed_done.set()
    try:
        slow = _job("slow", 5, slow_done)
        slow.policy = _Preparing(gate)
        failed = DecodeJob("failed", _job("failed", 5, failed_done).handoff, SamplingParams(0.0, 1.0, 0, None, 5),
                           failing_emit, policy=_Preparing(gate, RuntimeError("index build failed")))
        batcher.submit(slow)
        batcher.submit(failed)
        batcher.submit(_job("fast", 5, fast_done))
        assert fast_done.wait(10) and failed_done.wait(10)   # the others went on; the failed one alone failed
        assert not slow_done.is_set()
        assert errors and errors[-1] is not None and errors[-1].kind == "internal"
        gate.set()
        assert slow_done.wait(10)
    finally:
        batcher.stop()
    steps = [n for kind, n in eng.log if kind == "step"]
    assert steps[:4] == [1, 1, 1, 1] and steps[-1] == 1     # the fast one's steps alone, then the slow one's


def _recording_job(rid: str, errors: list, done: threading.Event, tokens: int = 3, policy=DENSE) -> DecodeJob:
    """A job whose end (its error, None when it finished) is appended to ``errors``."""
    def emit(new, reason, error):
        if error is not None or reason is not None:
            errors.append(error)
            done.set()
    prepared = _job(rid, tokens, done).handoff
    return DecodeJob(rid, prepared, SamplingParams(0.0, 1.0, 0, None, tokens), emit, policy=policy)


def test_the_index_service_failing_fails_its_requests_clearly_and_never_the_worker():
    """A sequence whose offload the retrieval index service failed fails saying so (not an error id); a step whose
    search failed fails its batch the same way, however many steps in a row, and the worker goes on serving."""
    from services.decode.batcher import MAX_FAILED_STEPS
    from services.decode.indexes import IndexUnavailable

    failure = IndexUnavailable("the decode worker's retrieval index service failed to search layer 0: UNAVAILABLE")

    class SearchFails(StandInEngine):
        failing = MAX_FAILED_STEPS + 1

        def decode_step(self, seqs, tokens):
            if self.failing:
                self.failing -= 1
                raise failure
            return super().decode_step(seqs, tokens)

    eng = SearchFails()
    eng.step_gate.set()
    batcher = Batcher(eng, DecodeMetrics(), max_batch=8, name="decode worker w")
    try:
        errors, done = [], threading.Event()
        batcher.submit(_recording_job("offload", errors, done, policy=_Preparing(threading.Event(), failure)))
        assert done.wait(10)
        assert errors[-1].kind == "internal" and errors[-1].message == f"decode worker w, request offload: {failure}"
        for i in range(MAX_FAILED_STEPS + 1):       # one step after another fails: more than a broken engine's limit
            done.clear()
            batcher.submit(_recording_job(f"search{i}", errors, done))
            assert done.wait(10)
            assert errors[-1].message == f"decode worker w: a decode step failed: {failure}"
        done.clear()
        batcher.submit(_recording_job("after", errors, done))
        assert done.wait(10) and errors[-1] is None and batcher.alive
    finally:
        batcher.stop()
