"""The prefill worker's engine loop: one thread, a prefill finished after the next one has begun."""

import threading

import pytest

from services.prefill.engine_loop import EngineLoop


def _prefill(log, name, gate=None):
    def begin():
        if gate is not None:
            gate.wait(5)
        log.append(f"begin {name}")
        return lambda: log.append(f"finish {name}") or name
    return begin


def test_a_queued_prefill_begins_before_the_earlier_one_finishes():
    loop, log, gate = EngineLoop(), [], threading.Event()
    try:
        futs = [loop.prefill(_prefill(log, "a", gate)), loop.prefill(_prefill(log, "b")),
                loop.prefill(_prefill(log, "c"))]
        gate.set()
        assert [f.result(5) for f in futs] == ["a", "b", "c"]
        # each finish follows the next begin, never more than one prefill waits unfinished
        assert log == ["begin a", "begin b", "finish a", "begin c", "finish b", "finish c"]
    finally:
        loop.stop()


def test_a_lone_prefill_is_finished_at_once_and_calls_run_alone():
    loop, log = EngineLoop(), []
    try:
        assert loop.prefill(_prefill(log, "a")).result(5) == "a"
        assert log == ["begin a", "finish a"]
        gate = threading.Event()
        first = loop.prefill(_prefill(log, "b", gate))
        call = loop.call(lambda: log.append("call") or 7)
        gate.set()
        assert call.result(5) == 7 and first.result(5) == "b"
        assert log[2:] == ["begin b", "finish b", "call"]      # the waiting prefill finished before the call
    finally:
        loop.stop()


def test_errors_reach_their_own_request_and_the_loop_goes_on():
    loop, log = EngineLoop(), []

    def bad_begin():
        raise ValueError("empty request")

    def bad_finish():
        return lambda: (_ for _ in ()).throw(RuntimeError("device lost"))

    try:
        futs = [loop.prefill(bad_begin), loop.prefill(bad_finish), loop.prefill(_prefill(log, "ok"))]
        with pytest.raises(ValueError, match="empty request"):
            futs[0].result(5)
        with pytest.raises(RuntimeError, match="device lost"):
            futs[1].result(5)
        assert futs[2].result(5) == "ok"
    finally:
        loop.stop()


def test_stop_cancels_what_has_not_started():
    loop, log, gate, entered = EngineLoop(), [], threading.Event(), threading.Event()

    def begin_a():
        entered.set()
        return _prefill(log, "a", gate)()

    started = loop.prefill(begin_a)
    queued = loop.prefill(_prefill(log, "b"))
    assert entered.wait(5)              # "a" has started (on a busy machine the thread may not have yet)
    threading.Timer(0.05, gate.set).start()
    loop.stop()
    assert started.result(5) == "a" and queued.cancelled() and "begin b" not in log


def test_waiting_counts_what_is_queued_behind_the_prefill_begun():
    """What the loading controller reads (``PrefillWorker.backlog``): the submissions not yet begun."""
    loop, log, gate, seen = EngineLoop(), [], threading.Event(), []

    def begin_a():
        assert gate.wait(5)
        seen.append(loop.waiting())          # b and the call queued behind a, while a begins
        return lambda: "a"

    try:
        assert loop.waiting() == 0
        futs = [loop.prefill(begin_a), loop.prefill(_prefill(log, "b")), loop.call(lambda: 7)]
        gate.set()
        assert [f.result(5) for f in futs] == ["a", "b", 7]
        assert seen == [2] and loop.waiting() == 0
    finally:
        loop.stop()


def test_the_servicer_gives_its_worker_the_loops_backlog():
    """The prefill servicer wires its engine loop's queue into the worker the loading controller asks."""
    from types import SimpleNamespace

    import torch

    from services.prefill.server import PrefillServicer

    worker = SimpleNamespace(eng=SimpleNamespace(device=torch.device("cpu")), backlog=lambda: -1)
    servicer = PrefillServicer(worker, "w", "http://127.0.0.1:1/metrics", handoff_transport="grpc")
    try:
        gate, started = threading.Event(), threading.Event()
        first = servicer.engine.call(lambda: started.set() or gate.wait(5))
        assert started.wait(5)
        queued = servicer.engine.call(lambda: 7)
        assert worker.backlog() == 1             # ``queued`` waits behind the call begun
        gate.set()
        assert first.result(5) and queued.result(5) == 7 and worker.backlog() == 0
    finally:
        servicer.engine.stop()
