"""``tessera replay``: a run with failed requests exits non-zero (--max-error-rate) and names them;
--offset / --limit replay a window of the trace, each request keeping its index."""

from __future__ import annotations

import json

import pytest

from loadgen.replay import ReplayConfig, ReplayRequest, StreamEvent, replay
from loadgen.trace import LengthDist, SynthConfig, synthesize, write_trace
from services.cli import main

TRACE = synthesize(SynthConfig(docs=10, chunks_per_request=2, requests=12, rate=1000.0, seed=1,
                               doc_tokens=LengthDist.parse("const:16"),
                               suffix_tokens=LengthDist.parse("const:4"),
                               output_tokens=LengthDist.parse("const:2")))


def _replay(tmp_path, *extra: str, target: str = "fake:base_ms=0,tpot_ms=0") -> int:
    path = tmp_path / "t.jsonl"
    write_trace(path, TRACE)
    return main(["replay", str(path), "--target", target, "--concurrency", "2", *extra,
                 "-o", str(tmp_path / "out")])


def test_replay_exits_non_zero_when_every_request_fails(tmp_path, capsys):
    assert _replay(tmp_path, target="fake:base_ms=0,tpot_ms=0,fail_every=1") == 1
    err = capsys.readouterr().err
    assert "tessera replay: error: mode tessera: 12 of 12 requests failed (100.0%, over --max-error-rate 0)" in err
    shown = [line for line in err.splitlines() if line.startswith("  request ")]
    assert shown == [f"  request {i}: RuntimeError: fake target: request tessera-{i} failed mid-stream"
                     for i in range(5)]
    assert (tmp_path / "out" / "summary.md").exists()     # the report is written all the same


@pytest.mark.parametrize("max_rate,rc", [("0", 1), ("0.4", 1), ("0.5", 0), ("1", 0)])
def test_max_error_rate_is_the_fraction_allowed_to_fail(tmp_path, capsys, max_rate, rc):
    # every second request fails: 50%
    assert _replay(tmp_path, "--max-error-rate", max_rate,
                   target="fake:base_ms=0,tpot_ms=0,fail_every=2") == rc
    assert ("6 of 12 requests failed" in capsys.readouterr().err) == bool(rc)


def test_a_run_without_failures_exits_zero(tmp_path, capsys):
    assert _replay(tmp_path) == 0
    assert "error" not in capsys.readouterr().err


def test_offset_and_limit_replay_a_window_of_the_trace(tmp_path, capsys):
    assert _replay(tmp_path, "--offset", "3", "--limit", "4") == 0
    lines = (tmp_path / "out" / "tessera" / "requests.jsonl").read_text().splitlines()
    assert [json.loads(line)["index"] for line in lines] == [3, 4, 5, 6]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert "--limit 4" in summary["command"] and "--offset 3" in summary["command"]
    assert _replay(tmp_path, "--offset", "10", "--limit", "5") == 0        # to the end: 10, 11
    lines = (tmp_path / "out" / "tessera" / "requests.jsonl").read_text().splitlines()
    assert [json.loads(line)["index"] for line in lines] == [10, 11]


class _Recorder:
    def __init__(self) -> None:
        self.sent: list[ReplayRequest] = []

    def generate(self, request):
        self.sent.append(request)
        yield StreamEvent((0,))


def test_a_request_in_a_window_is_the_request_of_a_whole_replay():
    whole, part = _Recorder(), _Recorder()
    replay(TRACE, whole, ReplayConfig(concurrency=1))
    window = replay(TRACE, part, ReplayConfig(concurrency=1, offset=5, limit=3))
    assert [r.index for r in window.records] == [5, 6, 7]
    assert part.sent == whole.sent[5:8]                 # same id, chunks and suffix tokens
    open_loop = replay(TRACE, _Recorder(), ReplayConfig(offset=5, limit=3))   # the trace's own times
    assert [r.scheduled_s for r in open_loop.records] == pytest.approx(
        [(TRACE[i].timestamp_ms - TRACE[5].timestamp_ms) / 1e3 for i in (5, 6, 7)])


@pytest.mark.parametrize("extra,message", [
    (("--offset", "12"), "offset 12 is past the end of the trace (12 requests)"),
    (("--offset", "-1"), "need offset >= 0 and limit >= 1"),
    (("--limit", "0"), "need offset >= 0 and limit >= 1"),
    (("--max-error-rate", "1.5"), "--max-error-rate must be a fraction in [0, 1], got 1.5"),
])
def test_bad_windows_and_rates_are_refused_before_any_request(tmp_path, capsys, extra, message):
    assert _replay(tmp_path, *extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("tessera replay: error: ") and message in err
    assert not (tmp_path / "out").exists()
