"""Steady-state throughput (counted between the first completion and the last send), several open-loop
rates after one reset, and the rate-sweep table and plot."""

from __future__ import annotations

import json

import pytest

from loadgen.replay import ReplayConfig, RequestRecord, replay, summarize
from loadgen.replay.compare import replay_rates
from loadgen.replay.fake import FakeTarget, FakeTargetConfig, VirtualClock
from loadgen.replay.plots import rate_sweep
from loadgen.replay.report import rate_sweep_rows, rate_sweep_table, summary_rows, summary_table
from loadgen.replay.runner import ReplayRun
from loadgen.trace import BlockHasher, Chunk, TraceRequest

_HASHER = BlockHasher()


def _req(docs: list[int], tokens: int = 100, suffix: int = 20, out: int = 5) -> TraceRequest:
    chunks = tuple(Chunk(d, tokens) for d in docs)
    return TraceRequest(0.0, tokens * len(docs) + suffix, out, _HASHER.hash_ids(chunks, suffix), chunks, suffix)


TRACE = [_req([1, 2]), _req([2, 1]), _req([3, 1]), _req([1, 2])]


def rec(i: int, sent: float, e2el: float | None, out: int = 1, inp: int = 100, ttft: float = 0.1) -> RequestRecord:
    """A finished request sent at ``sent`` s and done ``e2el`` s later; e2el None: it failed."""
    failed = e2el is None
    return RequestRecord(i, f"r{i}", "tessera", sent, sent, None if failed else ttft, e2el, (), inp, 80, out,
                         error="RuntimeError: boom" if failed else None)


def test_steady_throughput_counts_between_the_first_completion_and_the_last_send():
    records = (rec(0, 0.0, 2.0, out=1),      # done at 2: opens the window, not counted
               rec(1, 0.0, 3.0, out=2),      # done at 3
               rec(2, 2.0, 2.0, out=4),      # done at 4
               rec(3, 3.0, 3.0, out=8),      # done at 6 = the last send: counted
               rec(4, 4.0, 4.0, out=16),     # done at 8: the drain, after the window
               rec(5, 6.0, 1.0, out=32),     # the last send (6); done at 7
               rec(6, 9.0, None))            # failed: its send does not stretch the window
    s = summarize(ReplayRun("tessera", records, 10.0))
    assert s.steady_window_s == pytest.approx(4.0) and s.steady_completed == 4
    assert s.steady_request_throughput == pytest.approx(3 / 4)
    assert s.steady_output_throughput == pytest.approx((2 + 4 + 8) / 4)
    assert s.steady_total_token_throughput == pytest.approx((2 + 4 + 8 + 3 * 100) / 4)
    # the whole-run figures are unchanged: completed / duration
    assert s.request_throughput == pytest.approx(6 / 10) and s.output_throughput == pytest.approx(63 / 10)
    rows = dict(summary_rows([s]))
    assert rows["Request throughput, steady (req/s)"] == ["0.75"]
    assert rows["Total token throughput, steady (tok/s)"] == ["78.50"]
    assert json.loads(json.dumps(s.to_json()))["steady_request_throughput"] == pytest.approx(0.75)


@pytest.mark.parametrize("records,window,completed", [
    ((), None, 0),                                              # nothing succeeded
    ((rec(0, 0.0, None), rec(1, 1.0, None)), None, 0),
    ((rec(0, 0.0, 1.0),), None, 0),                            # one request: the last send precedes its completion
    ((rec(0, 0.0, 1.0), rec(1, 0.0, 2.0)), None, 0),           # every send before the first completion
    ((rec(0, 0.0, 1.0), rec(1, 5.0, 2.0)), 4.0, 1),            # a window holding only the opening completion
], ids=["empty", "all-failed", "one", "no-window", "one-completion"])
def test_steady_throughput_is_none_without_a_window_of_two_completions(records, window, completed):
    s = summarize(ReplayRun("tessera", records, 10.0))
    assert s.steady_request_throughput is None and s.steady_output_throughput is None
    assert s.steady_total_token_throughput is None
    assert s.steady_window_s == window and s.steady_completed == completed
    assert "| Request throughput, steady (req/s) | - |" in summary_table([s])


def test_steady_throughput_of_a_sequential_run_in_virtual_time():
    # one client: each request is sent when the one before ends, so the window runs from the first
    # completion to the last send and holds the completions of requests 0 .. n-2
    clock = VirtualClock()
    cfg = FakeTargetConfig(base_ms=2.0, compute_us_per_token=10.0, tpot_ms=4.0)
    run = replay(TRACE * 2, FakeTarget(cfg, clock), ReplayConfig(mode="tessera", concurrency=1), clock=clock)
    e2el = [r.e2el_s for r in run.records]
    s = summarize(run)
    assert s.steady_window_s == pytest.approx(sum(e2el[1:-1]))
    assert s.steady_completed == len(e2el) - 1
    assert s.steady_request_throughput == pytest.approx((len(e2el) - 2) / sum(e2el[1:-1]))
    assert s.request_throughput == pytest.approx(len(e2el) / sum(e2el))


class _CountingResets(FakeTarget):
    def __init__(self, cfg: FakeTargetConfig) -> None:
        self.resets = 0
        super().__init__(cfg)

    def reset(self) -> None:
        self.resets += 1
        super().reset()


def test_replay_rates_resets_once_then_replays_each_rate():
    target = _CountingResets(FakeTargetConfig(base_ms=0, compute_us_per_token=0, dram_us_per_token=0,
                                              gpu_us_per_token=0, copy_us_per_token=0, tpot_ms=0))
    target.resets = 0
    runs, summaries = replay_rates(TRACE, target, ReplayConfig(mode="tessera", concurrency=4), [1e6, 2e6],
                                   progress=False)
    assert target.resets == 1
    assert [len(r.records) for r in runs] == [4, 4] and all(s.failed == 0 for s in summaries)
    # the second rate starts from the caches the first one left: every chunk is a hit
    assert summaries[0].hit_ratio < 1.0 and summaries[1].hit_ratio == pytest.approx(1.0)


def test_replay_rates_stops_sending_after_the_time_limit_and_refuses_bad_rates():
    target = _CountingResets(FakeTargetConfig(base_ms=0, compute_us_per_token=0, tpot_ms=0))
    target.resets = 0
    runs, _ = replay_rates(TRACE * 10, target, ReplayConfig(), [50.0], duration_s=0.1, progress=False)
    assert 0 < len(runs[0].records) < 40 and all(r.scheduled_s < 0.1 for r in runs[0].records)
    with pytest.raises(ValueError, match="rate must be > 0"):
        replay_rates(TRACE, target, ReplayConfig(), [1.0, 0.0], progress=False)
    assert target.resets == 1          # refused before any reset


def _summary(mode: str, ttft: float, scale: float, fail_last: bool = False):
    """Sends at 0, 1, 2, 3 (x scale) each done scale s later: steady throughput 1/scale req/s."""
    records = [rec(i, i * scale, scale, ttft=ttft) for i in range(4)]
    if fail_last:
        records[-1] = rec(3, 3 * scale, None)
    return summarize(ReplayRun(mode, tuple(records), 5 * scale))


def test_rate_sweep_rows_table_and_plot(tmp_path):
    sweep = {4.0: {"full": _summary("full", 0.9, 0.5), "tessera": _summary("tessera", 0.3, 0.25)},
             1.0: {"full": _summary("full", 0.6, 1.0, fail_last=True)}}
    rows = rate_sweep_rows(sweep, [("ttft_p50", "full", "tessera"), ("throughput", "tessera", "full")])
    assert [r["rate"] for r in rows] == [1.0, 4.0]                  # lowest rate first
    low, high = rows
    assert low["modes"]["full"] == {"ttft_p50_ms": pytest.approx(600.0), "ttft_p90_ms": pytest.approx(600.0),
                                    "throughput": pytest.approx(1.0), "throughput_whole_run": pytest.approx(3 / 5),
                                    "completed": 3, "sent": 4}
    assert low["ratios"] == {"ttft_p50 full/tessera": None, "throughput tessera/full": None}   # no tessera
    assert high["ratios"]["ttft_p50 full/tessera"] == pytest.approx(3.0)
    assert high["ratios"]["throughput tessera/full"] == pytest.approx((1 / 0.25) / (1 / 0.5))
    table = rate_sweep_table(rows).splitlines()
    assert table[0] == ("| offered (req/s) | full p50 TTFT (ms) | full p90 TTFT (ms) | full achieved (req/s) | "
                        "full done/sent | tessera p50 TTFT (ms) | tessera p90 TTFT (ms) | tessera achieved (req/s) | "
                        "tessera done/sent | p50 TTFT full/tessera | req/s tessera/full |")
    assert table[2] == "| 1 | 600.0 | 600.0 | 1.00 | 3/4 | - | - | - | - | - | - |"
    assert table[3] == "| 4 | 900.0 | 900.0 | 2.00 | 4/4 | 300.0 | 300.0 | 4.00 | 4/4 | 3.00x | 2.00x |"
    assert json.loads(json.dumps(rows, allow_nan=False)) == rows
    # a rate sent faster than served (every send before the first completion): no steady rate; the cell
    # falls back to completed / duration, in parentheses, and the ratio stays empty
    flood = {8.0: {"full": summarize(ReplayRun("full", (rec(0, 0.0, 1.0), rec(1, 0.5, 1.5)), 4.0)),
                   "tessera": _summary("tessera", 0.3, 0.25)}}
    row = rate_sweep_table(rate_sweep_rows(flood, [("throughput", "tessera", "full")])).splitlines()[2]
    assert row == "| 8 | 100.0 | 100.0 | (0.50) | 2/2 | 300.0 | 300.0 | 4.00 | 4/4 | - |"
    png = rate_sweep(rows, tmp_path / "rates.png", "alpha 1.1")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="unknown rate-table metric"):
        rate_sweep_rows(sweep, [("ttft_p99", "full", "tessera")])
