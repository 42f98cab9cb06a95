"""DecodeSettings.admit_during_step: hand-offs that arrive while a decode step runs are admitted beside it (after the
step is issued, before its tokens are read back), within max_batch and admit_budget_s, never ahead of an engine call
queued before them; and a cluster that does so answers exactly as the engine does."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.decode.batcher import Batcher
from services.decode.metrics import DecodeMetrics

from .test_batcher import StandInEngine, _job, _run


def _batcher(eng, **kw) -> Batcher:
    return Batcher(eng, DecodeMetrics(), admit_during_step=True, **kw)


def _first_live(batcher, eng, done) -> None:
    batcher.submit(_job("first", 40, done))
    for _ in range(1000):                   # bounded: the first sequence is live, its first step waiting at the gate
        if batcher.active == 1 and eng.log == [("import", "first")]:
            return
        threading.Event().wait(0.005)
    raise AssertionError("the first sequence never went live")


def _burst(eng, n: int, admit_budget_s: float = float("inf"), **kw) -> list:
    """test_batcher's burst (a first sequence live, ``n`` hand-offs arriving while its first step waits) with
    admissions during steps on; the engine's log."""
    return _run(admit_budget_s, n, eng, admit_during_step=True, **kw)


class _Tracked(StandInEngine):
    """Logs when the running step's tokens are read back: the batcher's argmax over the step's logits."""

    def decode_step(self, seqs, tokens):
        logits = super().decode_step(seqs, tokens)
        log = self.log

        class Logits(type(logits)):
            def argmax(self, *a, **k):
                log.append(("read back", len(seqs)))
                return super().argmax(*a, **k)

        return logits.as_subclass(Logits)


@pytest.mark.parametrize("budget, per_step", [(3600.0, 4), (0.0, 1)])
def test_a_burst_is_admitted_while_the_step_runs_within_the_budget(budget, per_step):
    kinds = [k for k, _ in _burst(_Tracked(), 4, max_batch=8, admit_budget_s=budget)]
    first = kinds.index("step")
    # admitted between the first step's issue and its tokens' read-back: beside the step, not after it
    assert kinds[first + 1:first + 1 + per_step] == ["import"] * per_step
    assert kinds[first + 1 + per_step] == "read back"
    # and never more than the budget allows between two read-backs (what the step admitted counts for the next gap)
    runs, n = [], 0
    for k in kinds[first:]:
        if k == "import":
            n += 1
        elif k == "read back":
            runs.append(n)
            n = 0
    assert max(runs) <= per_step and kinds.count("import") == 5


def test_the_batch_limit_holds_while_the_step_runs():
    log = _burst(StandInEngine(), 5, max_batch=3)
    assert max(n for k, n in log if k == "step") == 3
    assert sum(1 for k, _ in log if k == "import") == 6


def test_an_engine_call_queued_first_runs_between_steps_before_the_hand_offs_behind_it():
    eng = StandInEngine()
    batcher = _batcher(eng, max_batch=8)
    done = [threading.Event() for _ in range(3)]
    try:
        _first_live(batcher, eng, done[0])
        batcher.submit(_job("before", 3, done[1]))
        call = batcher.call(lambda: eng.log.append(("call", None)))
        batcher.submit(_job("after", 3, done[2]))
        eng.step_gate.set()
        call.result(10)
        assert all(d.wait(10) for d in done)
    finally:
        batcher.stop()
    order = [(k, v) for k, v in eng.log if k in ("import", "call", "step")]
    first = order.index(("step", 1))
    # "before" joins during the first step; the call stops the window, runs after the step, then "after" comes in
    assert order[first + 1:first + 4] == [("import", "before"), ("call", None), ("import", "after")]


@pytest.mark.slow
def test_a_cluster_admitting_during_steps_answers_as_the_engine(tiny_model, reference, tmp_path):
    from services.cluster.config import DecodeSettings
    from services.sdk import Client

    from tests.helpers import InProcessCluster, docs

    (tmp_path / "rocksdb").mkdir()
    cluster = InProcessCluster(tiny_model, tmp_path / "rocksdb", internal_tls=False,
                               decode_settings=DecodeSettings(host_cache_bytes=32 << 20, admit_during_step=True))
    try:
        pool = docs(4, 32, seed=21)
        requests = [([pool[i % 4], pool[(i * 3 + 1) % 4]], [i + 1, 7]) for i in range(12)]
        with Client(cluster.address, timeout=120) as client, ThreadPoolExecutor(12) as ex:
            got = list(ex.map(lambda r: client.complete(r[0], r[1], max_new_tokens=8, recompute_ratio=0.15,
                                                        stop_token_ids=[]), requests))
        for (chunks, suffix), out in zip(requests, got):
            assert list(out.token_ids) == reference.generate(chunks, suffix, max_new_tokens=8, recompute_ratio=0.15,
                                                             stop_token_ids=[])
    finally:
        cluster.stop()
