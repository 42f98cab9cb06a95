"""No single request stops a worker's engine loop; a loop that stops for good says so.

Against stand-in engines (no model): a degenerate sampling value, a sequence whose logits are not finite,
a failing step, a broken device (every step fails), and the prefill engine loop's own liveness."""

from __future__ import annotations

import math
import threading
from types import SimpleNamespace

import pytest
import torch

from services.cluster.errors import RequestError
from services.decode.batcher import MAX_FAILED_STEPS, Batcher, DecodeJob
from services.decode.metrics import DecodeMetrics
from services.engine.decode import DecodeStats
from services.engine.sampling import NonFiniteLogits, SamplingParams, sample
from services.prefill.engine_loop import EngineLoop

VOCAB = 16


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 1e-30, 1e-12])
def test_a_tiny_temperature_samples_the_greedy_token(temperature):
    """Dividing the logits by it overflowed to inf and the distribution to NaN (multinomial raised)."""
    logits = torch.randn(VOCAB) * 30
    gen = torch.Generator().manual_seed(1)
    assert sample(logits, SamplingParams(temperature, 1.0, 0, 1), gen) == int(logits.argmax())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_logits_that_are_not_finite_are_named_not_sampled(bad):
    logits = torch.randn(VOCAB)
    logits[3] = bad
    with pytest.raises(NonFiniteLogits, match="not finite"):
        sample(logits, SamplingParams(0.7, 1.0, 0, 1), torch.Generator().manual_seed(1))


@pytest.mark.parametrize("field,value", [("temperature", math.nan), ("temperature", math.inf),
                                         ("top_p", math.nan)])
def test_sampling_values_that_are_not_finite_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


class StandIn:
    """A decode engine without a model. ``poison``: request ids whose row of logits is NaN;
    ``fail_steps``: how many of the next steps raise."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.cache = SimpleNamespace(keys=lambda: [])
        self.poison: set[str] = set()
        self.fail_steps = 0
        self.released = 0

    def import_handoff(self, handoff, fetch=None, decode="dense", layout=None):
        return SimpleNamespace(request_id=handoff.request_id, decode=decode, decode_stats=DecodeStats())

    def decode_step(self, seqs, tokens):
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        logits = torch.randn(len(seqs), VOCAB)
        for i, s in enumerate(seqs):
            if s.request_id in self.poison:
                logits[i] = float("nan")
        return logits

    def release(self, seq) -> None:
        self.released += 1


class Outcome:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.reason: str | None = None
        self.error: RequestError | None = None
        self.done = threading.Event()

    def emit(self, toks, reason, error) -> None:
        self.tokens += toks
        if reason is not None or error is not None:
            self.reason, self.error = reason, error
            self.done.set()


def _job(rid: str, n: int, temperature: float = 0.7) -> tuple[DecodeJob, Outcome]:
    handoff = SimpleNamespace(request_id=rid, logits=torch.randn(VOCAB))
    header = SimpleNamespace(HasField=lambda name: False)
    prepared = SimpleNamespace(adopt=lambda: None, handoff=handoff, fetched={}, chunk_indexes={}, layout=None,
                               received=SimpleNamespace(header=header))
    out = Outcome()
    sampling = SamplingParams(temperature, 1.0, 0, 7, n)
    return DecodeJob(rid, prepared, sampling, out.emit), out


def test_one_sequence_with_broken_logits_fails_alone_and_the_batch_goes_on():
    eng = StandIn()
    eng.poison.add("bad")
    fatal = []
    batcher = Batcher(eng, DecodeMetrics(), max_batch=8, on_fatal=fatal.append, name="decode worker t")
    try:
        good, good_out = _job("good", 6)
        bad, bad_out = _job("bad", 6)
        batcher.submit(good)
        batcher.submit(bad)
        assert good_out.done.wait(10) and bad_out.done.wait(10)
        assert good_out.reason == "length" and len(good_out.tokens) == 6 and good_out.error is None
        assert bad_out.error is not None and bad_out.error.kind == "internal"
        # the caller learns an id, never the Python exception's text
        assert "internal error" in bad_out.error.message and "NonFiniteLogits" not in bad_out.error.message
        later, later_out = _job("later", 3, temperature=1e-40)      # a degenerate value after it
        batcher.submit(later)
        assert later_out.done.wait(10) and later_out.reason == "length"
        assert batcher.alive and not fatal
    finally:
        batcher.stop()


def test_a_failing_step_fails_its_batch_and_the_loop_serves_the_next_one():
    eng = StandIn()
    eng.fail_steps = 1
    batcher = Batcher(eng, DecodeMetrics(), max_batch=8)
    try:
        first, first_out = _job("first", 4)
        batcher.submit(first)
        assert first_out.done.wait(10)
        assert first_out.error is not None and first_out.error.kind == "internal"
        assert "illegal memory access" not in first_out.error.message
        second, second_out = _job("second", 4)
        batcher.submit(second)
        assert second_out.done.wait(10) and second_out.reason == "length"
        assert batcher.alive
    finally:
        batcher.stop()


def test_a_broken_device_stops_the_loop_for_good_and_says_so():
    """Every step failing: after MAX_FAILED_STEPS in a row the loop stops, jobs waiting are failed, ``alive``
    turns False and on_fatal runs (the server then says NOT_SERVING and the actor exits to be restarted)."""
    eng = StandIn()
    eng.fail_steps = 10 ** 6
    fatal = threading.Event()
    batcher = Batcher(eng, DecodeMetrics(), max_batch=1, on_fatal=lambda exc: fatal.set())
    outs = []
    try:
        for i in range(MAX_FAILED_STEPS + 2):
            job, out = _job(f"r{i}", 4)
            outs.append(out)
            batcher.submit(job)
        assert fatal.wait(10)
        assert not batcher.alive
        assert all(o.done.wait(10) and o.error is not None and o.error.kind == "internal" for o in outs)
        late, late_out = _job("late", 4)          # a hand-off arriving after the loop stopped: failed at once
        batcher.submit(late)
        assert late_out.done.is_set() and late_out.error is not None and late_out.error.kind == "internal"
        with pytest.raises(RuntimeError, match="engine loop"):
            batcher.call(lambda: 1).result(0)
    finally:
        batcher.stop()


def test_the_prefill_engine_loop_reports_its_death():
    fatal = threading.Event()
    loop = EngineLoop(on_fatal=lambda exc: fatal.set())
    try:
        assert loop.alive
        assert loop.call(lambda: 1 + 1).result(5) == 2
        with pytest.raises(ZeroDivisionError):      # a call's error is its caller's: the loop goes on
            loop.call(lambda: 1 / 0).result(5)
        assert loop.alive
        loop._serve = lambda: (_ for _ in ()).throw(SystemError("escaped"))   # noqa: SLF001 - simulate
        loop._thread = threading.Thread(target=loop._run, daemon=True)        # a loop whose body escapes
        loop._thread.start()
        assert fatal.wait(5)
        assert not loop.alive
    finally:
        loop.stop(1)
