"""Replay against a fake in-process target: exact latencies in virtual time, schedules,
failures, the summary, the report files and plots, and the CLI."""

from __future__ import annotations

import json
import threading

import pytest

from loadgen.replay import (MODES, ReplayConfig, ReplayRequest, RequestRecord, RequestStats, Slo,
                            StreamEvent, replay, summarize)
from loadgen.replay.fake import FakeTarget, FakeTargetConfig, VirtualClock
from loadgen.replay.plots import hit_ratio_series
from loadgen.replay.report import summary_rows, summary_table, write_report
from loadgen.replay.runner import ReplayRun
from loadgen.trace import BlockHasher, Chunk, TraceRequest, write_trace
from services.cli import main

CFG = FakeTargetConfig(base_ms=2.0, compute_us_per_token=10.0, dram_us_per_token=3.0,
                       gpu_us_per_token=1.0, copy_us_per_token=0.5, tpot_ms=4.0, gpu_tokens=1000,
                       dram_tokens=10_000)


def _req(ts_ms: float, docs: list[int], tokens: int = 100, suffix: int = 20, out: int = 5) -> TraceRequest:
    chunks = tuple(Chunk(d, tokens) for d in docs)
    return TraceRequest(ts_ms, tokens * len(docs) + suffix, out, _HASHER.hash_ids(chunks, suffix),
                        chunks, suffix)


_HASHER = BlockHasher()


TRACE = [_req(0, [1, 2]), _req(10, [2, 1]), _req(20, [3, 1]), _req(30, [1, 2])]


def test_exact_latencies_in_virtual_time():
    clock = VirtualClock()
    run = replay(TRACE, FakeTarget(CFG, clock), ReplayConfig(mode="tessera", concurrency=1), clock=clock)
    r0, r1, r2, _ = run.records
    assert r0.tier_tokens == {"gpu": 0, "dram": 0, "computed": 200}
    assert r0.ttft_s == pytest.approx(2e-3 + 10e-6 * (200 + 20))
    assert r1.tier_tokens == {"gpu": 200, "dram": 0, "computed": 0}          # order does not matter
    assert r1.ttft_s == pytest.approx(2e-3 + 1e-6 * 200 + 10e-6 * 20)
    assert r2.tier_tokens == {"gpu": 100, "dram": 0, "computed": 100}
    for r in run.records:
        assert r.itl_s == pytest.approx((4e-3,) * 4) and r.output_tokens == 5
        assert r.e2el_s == pytest.approx(r.ttft_s + 4 * 4e-3)
    s = summarize(run)
    assert s.tpot_ms["p50"] == pytest.approx(4.0) and s.itl_ms["p99"] == pytest.approx(4.0)
    assert s.hit_ratio == pytest.approx((200 + 100 + 200) / 800)
    assert s.tier_hit_ratios == pytest.approx({"gpu": 500 / 800, "dram": 0.0, "computed": 300 / 800})
    assert s.duration_s == pytest.approx(sum(r.e2el_s for r in run.records))


@pytest.mark.parametrize("mode,hits", [("full", 0), ("prefix", 200), ("position_aware", 300),
                                       ("blend_copy", 500), ("tessera", 500)])
def test_modes_reuse_as_their_policy_says(mode, hits):
    clock = VirtualClock()
    run = replay(TRACE, FakeTarget(CFG, clock), ReplayConfig(mode=mode, concurrency=1), clock=clock)
    assert sum(r.chunk_tokens - r.tier_tokens["computed"] for r in run.records) == hits


def test_a_small_gpu_tier_spills_hits_to_dram():
    clock = VirtualClock()
    cfg = FakeTargetConfig(gpu_tokens=100, dram_tokens=10_000, tpot_ms=0)
    run = replay(TRACE, FakeTarget(cfg, clock), ReplayConfig(concurrency=1), clock=clock)
    assert sum(r.tier_tokens["dram"] for r in run.records) > 0


def test_summary_figures_from_records():
    def rec(i, ttft, e2el, out, error=None, tiers=None, stages=None):
        return RequestRecord(i, f"r{i}", "tessera", 0.0, 0.0, None if error else ttft,
                             None if error else e2el, (), 100, 80, out, tiers or {}, 0, error, stages or {})
    records = (rec(0, 0.1, 1.1, 11, tiers={"gpu": 60, "computed": 20}, stages={"prefill": 0.02, "hand-off": 0.004}),
               rec(1, 0.3, 0.3, 1, tiers={"dram": 80}, stages={"prefill": 0.04}),
               rec(2, 0.2, 2.2, 5),
               rec(3, 0, 0, 0, error="RuntimeError: boom"))
    s = summarize(ReplayRun("tessera", records, 2.0), Slo.parse("ttft:250,tpot:200"))
    assert (s.completed, s.failed) == (3, 1)
    assert s.ttft_ms["mean"] == pytest.approx(200.0) and s.ttft_ms["p50"] == pytest.approx(200.0)
    assert s.tpot_ms["mean"] == pytest.approx((100.0 + 500.0) / 2)      # request 1 has one token
    assert s.e2el_ms["p90"] == pytest.approx(1100 + 0.8 * 1100)
    assert s.request_throughput == pytest.approx(1.5) and s.output_throughput == pytest.approx(8.5)
    assert s.goodput == pytest.approx(1 / 2.0)     # only request 0 meets ttft and tpot
    assert s.chunk_tokens == 160 and s.hit_ratio == pytest.approx(140 / 160)
    assert list(s.tier_hit_ratios) == ["gpu", "dram", "computed"]
    # stage medians over the requests that report each stage
    assert s.stage_p50_ms == pytest.approx({"prefill": 30.0, "hand-off": 4.0})
    rows = dict(summary_rows([s]))
    assert rows["Stage p50 (ms): prefill"] == ["30.00"] and rows["Stage p50 (ms): hand-off"] == ["4.00"]
    # and their means, which one slow request moves and the median does not
    slow = records[:2] + (rec(3, 0.2, 0.5, 4, stages={"prefill": 0.15}),)
    m = summarize(ReplayRun("tessera", slow, 2.0))
    assert m.stage_p50_ms["prefill"] == pytest.approx(40.0) and m.stage_mean_ms["prefill"] == pytest.approx(70.0)
    assert dict(summary_rows([m]))["Stage mean (ms): prefill"] == ["70.00"]


@pytest.mark.parametrize("bad", ["", "ttft", "latency:5", "ttft:fast", "tpot:-1"])
def test_bad_slos_are_refused(bad):
    with pytest.raises(ValueError):
        Slo.parse(bad)


def test_open_loop_follows_the_schedule_and_duration():
    target = FakeTarget(FakeTargetConfig(base_ms=0, compute_us_per_token=0, tpot_ms=0))
    run = replay(TRACE, target, ReplayConfig(duration_s=0.015))
    assert [r.index for r in run.records] == [0, 1]               # 20 ms and 30 ms not sent
    assert [r.scheduled_s for r in run.records] == [0.0, 0.01]
    assert all(r.ok and r.output_tokens == 5 for r in run.records)
    retimed = replay(TRACE, target, ReplayConfig(rate=1e6))
    assert len(retimed.records) == 4 and retimed.records[-1].scheduled_s < 1e-3


class _CountingTarget:
    """Streams two tokens; the first three requests wait until all three are in flight."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n, timeout=30)
        self.lock, self.active, self.peak = threading.Lock(), 0, 0

    def generate(self, request: ReplayRequest):
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            if request.index < self.barrier.parties:
                self.barrier.wait()
            yield StreamEvent((1,))
            yield StreamEvent((2,), RequestStats({"computed": sum(request.chunk_lengths)}))
        finally:
            with self.lock:
                self.active -= 1


def test_closed_loop_keeps_concurrency_requests_in_flight():
    target = _CountingTarget(3)
    run = replay(TRACE * 3, target, ReplayConfig(concurrency=3))
    assert len(run.records) == 12 and all(r.ok for r in run.records)
    assert target.peak == 3


def test_requests_carry_deterministic_document_tokens():
    seen: list[ReplayRequest] = []

    class Recorder:
        def generate(self, request):
            seen.append(request)
            yield StreamEvent((0,))

    replay(TRACE, Recorder(), ReplayConfig(concurrency=1, vocab_size=1000, token_low=10))
    by_doc = {}
    for req in seen:
        assert req.chunk_lengths == (100, 100) and len(req.suffix) == 20
        for doc, toks in zip(req.doc_ids, req.chunks):
            assert by_doc.setdefault(doc, toks) == toks
            assert min(toks) >= 10 and max(toks) < 1000
    assert seen[0].suffix != seen[3].suffix     # suffixes are private


def test_failures_are_recorded_not_raised():
    cfg = FakeTargetConfig(base_ms=0, compute_us_per_token=0, tpot_ms=0, fail_every=2)
    run = replay(TRACE, FakeTarget(cfg), ReplayConfig(concurrency=2))
    failed = [r for r in run.records if not r.ok]
    assert [r.index for r in failed] == [1, 3]
    assert "failed mid-stream" in failed[0].error and failed[0].ttft_s is None
    assert summarize(run).failed == 2


def test_report_files_and_plots(tmp_path):
    runs = []
    for mode in ("full", "tessera"):
        clock = VirtualClock()
        runs.append(replay(TRACE, FakeTarget(CFG, clock), ReplayConfig(mode=mode, concurrency=1), clock=clock))
    summaries = [summarize(r, Slo(ttft_ms=3.0)) for r in runs]
    paths = write_report(tmp_path, runs, summaries, "tessera replay t.jsonl --target fake")
    for key in ("ttft_cdf", "hit_ratio"):
        assert paths[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = (tmp_path / "tessera" / "requests.jsonl").read_text().splitlines()
    assert [json.loads(line)["index"] for line in lines] == [0, 1, 2, 3]
    assert json.loads((tmp_path / "full" / "summary.json").read_text())["hit_ratio"] == 0.0
    md = paths["summary_md"].read_text()
    assert "| metric | full | tessera |" in md and "Goodput (req/s, ttft <= 3 ms)" in md
    assert "p50 TTFT speed-up vs full" in summary_table(summaries)
    x, y = hit_ratio_series(runs[1], bins=4)
    assert len(x) == len(y) > 0 and 0 <= y.min() <= y.max() <= 1
    assert "stages" not in paths and not (tmp_path / "serving_stages.png").exists()   # the fake reports none


def test_report_plots_the_serving_stages_when_the_target_reports_them(tmp_path):
    from dataclasses import replace

    from loadgen.replay.plots import STAGE_SEGMENTS

    clock = VirtualClock()
    run = replay(TRACE, FakeTarget(CFG, clock), ReplayConfig(mode="tessera", concurrency=1), clock=clock)
    stages = {"queue": 0.01, "first token": 0.03, "chunk compute": 0.02, "hand-off": 0.005}
    run = replace(run, records=tuple(replace(r, stage_s=stages) for r in run.records))
    summary = summarize(run)
    paths = write_report(tmp_path, [run], [summary], "tessera replay t.jsonl --target fake")
    assert paths["stages"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![serving stages](serving_stages.png)" in paths["summary_md"].read_text()
    # the bar's segments: queue, chunk compute, the rest of the pass to the first token, the hand-off after it
    widths = [get(summary.stage_p50_ms) for _, get in STAGE_SEGMENTS]
    assert widths == pytest.approx([10.0, 20.0, 10.0, 5.0])


def test_cli_replay_compare(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, TRACE)
    out = tmp_path / "results"
    rc = main(["replay", str(trace), "--target", "fake:tpot_ms=0.1,base_ms=0.1", "--compare",
               "full,prefix,tessera", "--concurrency", "2", "--slo", "ttft:100,tpot:50",
               "--vocab-size", "5000", "-o", str(out)])
    assert rc == 0
    assert "| metric | full | prefix | tessera |" in capsys.readouterr().out
    assert {p.name for p in out.iterdir()} >= {"full", "prefix", "tessera", "summary.md", "summary.json",
                                               "ttft_cdf.png", "hit_ratio_over_time.png"}
    assert "--compare full,prefix,tessera" in json.loads((out / "summary.json").read_text())["command"]


def test_cli_replay_refuses_what_it_cannot_do(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, TRACE)
    import socket

    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["replay", str(trace), "--target", f"127.0.0.1:{port}", "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"cannot reach the cluster at 127.0.0.1:{port}" in err
    assert not (tmp_path / "o").exists()
    assert main(["replay", str(trace), "--target", "fake:warp=9", "-o", str(tmp_path / "o")]) == 2
    assert main(["replay", str(trace), "--target", "fake", "--compare", "full,turbo",
                 "-o", str(tmp_path / "o")]) == 2
    with pytest.raises(SystemExit):
        main(["replay", str(trace), "--target", "fake", "--rate", "1", "--concurrency", "2", "-o", "x"])


def test_modes_match_the_engine():
    from services.engine.request import MODES as ENGINE_MODES
    assert MODES == ENGINE_MODES


def test_a_run_that_took_no_time_has_no_throughput():
    clock = VirtualClock()
    cfg = FakeTargetConfig(base_ms=0, compute_us_per_token=0, dram_us_per_token=0, gpu_us_per_token=0,
                           copy_us_per_token=0, tpot_ms=0)
    s = summarize(replay(TRACE, FakeTarget(cfg, clock), ReplayConfig(concurrency=1), clock=clock), Slo(ttft_ms=1))
    assert s.duration_s == 0 and s.request_throughput is None and s.goodput is None
    assert json.loads(json.dumps(s.to_json(), allow_nan=False))["completed"] == 4
    assert "| Request throughput (req/s) | - |" in summary_table([s])
