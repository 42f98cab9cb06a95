"""bench/cluster/cluster_probe.py reads the workers' real metric names: a renamed metric would otherwise be read
as zero and the benchmark's time budget would silently go blank."""

import importlib.util
from pathlib import Path

from prometheus_client import generate_latest

from services.decode.metrics import DecodeMetrics
from services.prefill.metrics import PrefillMetrics

_spec = importlib.util.spec_from_file_location(
    "cluster_probe", Path(__file__).resolve().parents[1] / "bench" / "cluster" / "cluster_probe.py")
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)


def test_time_budget_from_the_workers_metrics():
    p, d = PrefillMetrics(), DecodeMetrics()
    for s in (0.05, 0.07):
        p.seconds.observe(s)
    p.engine_seconds.inc(0.08)
    for r in (0.15, 0.35):
        p.ratio.observe(r)
    p.handoff_seconds.observe(0.01)
    for batch, s in ((4, 0.02), (6, 0.03)):
        d.batch_size.observe(batch)
        d.step_seconds.observe(s)
    d.admit_seconds.observe(0.004)
    d.chunks.labels("gpu").inc(5)
    d.chunks.labels("host").inc(2)
    p.handoffs.labels("cuda-ipc").inc(3)
    p.handoffs.labels("cuda-ipc-peer").inc()
    d.restaged.inc(2)
    d.admission_reads.inc()
    before = {}
    after = {}
    for reg in (p.registry, d.registry):
        for k, v in probe.parse_metrics(generate_latest(reg).decode()).items():
            after[k] = after.get(k, 0.0) + v
    used = probe.delta(after, before)
    assert probe.chunk_sources(used) == {"gpu": 5.0, "host": 2.0}
    b = probe.time_budget(used, duration_s=1.0, gpu_busy=50.0)
    assert b["prefills"] == 2 and abs(b["prefill_mean_ms"] - 60.0) < 1e-6
    assert abs(b["prefill_engine_busy_pct"] - 8.0) < 1e-6        # the engine thread's own time, not per-request spans
    assert abs(b["handoff_mean_ms"] - 5.0) < 1e-6 and abs(b["recompute_ratio_mean"] - 0.25) < 1e-9
    assert b["decode_steps"] == 2 and b["decode_mean_batch"] == 5.0 and abs(b["decode_step_mean_ms"] - 25.0) < 1e-6
    assert b["admits"] == 1 and abs(b["admit_mean_ms"] - 4.0) < 1e-6 and b["gpu_busy_pct"] == 50.0
    assert b["prefill_cpu_pct"] is None and b["store_errors"] == 0      # no process CPU or store errors here
    assert b["handoffs_by_transport"] == {"cuda-ipc": 3.0, "cuda-ipc-peer": 1.0}
    assert b["decode_restaged"] == 2 and b["decode_admission_reads"] == 1
    row = probe.budget_line("tessera", b)
    assert row.startswith("| tessera | 50% | 60.0 |") and row.count("|") == probe.BUDGET_HEADER[1].count("|")


def test_an_idle_run_reads_as_dashes_not_zero_division():
    b = probe.time_budget({}, duration_s=2.0, gpu_busy=None)
    assert b["prefill_mean_ms"] is None and b["decode_mean_batch"] is None and b["recompute_ratio_mean"] is None
    assert "| - |" in probe.budget_line("full", b)


def test_worker_cpu_is_read_per_role_from_the_process_metrics_every_service_serves():
    from prometheus_client import CollectorRegistry

    from services.cluster.serving import serve_metrics

    registry = CollectorRegistry()
    server, port = serve_metrics(registry, "127.0.0.1")
    try:
        import urllib.request

        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        server.shutdown()
    assert probe.parse_metrics(page)["cpu_s"] > 0          # this process has spent CPU

    class Stats:
        workers = [type("W", (), dict(role=r, name=f"{r}-{i}", metrics_url=f"url-{i}"))()
                   for i, r in enumerate(("prefill", "decode", "decode"))]
        metrics_url = "url-gateway"

    pages = {"url-0": "process_cpu_seconds_total 3.0\n", "url-1": "process_cpu_seconds_total 1.0\n",
             "url-2": "process_cpu_seconds_total 2.0\n", "url-gateway": "process_cpu_seconds_total 0.5\n"}
    meter = probe.WorkerMeter(type("C", (), dict(stats=lambda self: Stats()))())
    import unittest.mock

    with unittest.mock.patch.object(probe.urllib.request, "urlopen",
                                    lambda url, timeout: type("R", (), dict(read=lambda self: pages[url].encode()))()):
        snap = meter.snapshot()
    assert snap == {"cpu_s/prefill": 3.0, "cpu_s/decode": 3.0, "workers/prefill": 1.0, "workers/decode": 2.0,
                    "w:prefill/prefill-0|cpu_s": 3.0, "w:decode/decode-1|cpu_s": 1.0, "w:decode/decode-2|cpu_s": 2.0,
                    "cpu_s/gateway": 0.5}
    b = probe.time_budget(probe.delta(snap, {"cpu_s/prefill": 1.0, "cpu_s/decode": 1.0, "workers/prefill": 1.0,
                                             "workers/decode": 2.0, "cpu_s/gateway": 0.1}), duration_s=2.0,
                          gpu_busy=None)
    assert b["prefill_cpu_pct"] == 100.0 and b["decode_cpu_pct"] == 50.0 and abs(b["gateway_cpu_pct"] - 20.0) < 1e-9


def test_each_worker_is_reported_on_its_own_so_an_uneven_split_shows():
    p0, p1, d0 = PrefillMetrics(), PrefillMetrics(), DecodeMetrics()
    for s in (0.05, 0.07, 0.02):
        p0.seconds.observe(s)
    p0.engine_seconds.inc(0.9)
    p1.seconds.observe(0.04)
    p1.engine_seconds.inc(0.1)
    for batch, s in ((4, 0.2), (6, 0.3)):
        d0.batch_size.observe(batch)
        d0.step_seconds.observe(s)
    d0.admit_seconds.observe(0.25)
    snap = {}
    for role, name, m in (("prefill", "p0", p0), ("prefill", "p1", p1), ("decode", "d0", d0)):
        for k, v in probe.parse_metrics(generate_latest(m.registry).decode()).items():
            snap[f"{probe.PER_WORKER}{role}/{name}|{k}"] = v
    rows = probe.per_worker(probe.delta(snap, {}), duration_s=1.0)
    assert [(r["role"], r["name"]) for r in rows] == [("decode", "d0"), ("prefill", "p0"), ("prefill", "p1")]
    d, a, b = rows
    assert a["prefills"] == 3 and abs(a["prefill_engine_busy_pct"] - 90.0) < 1e-6
    assert b["prefills"] == 1 and abs(b["prefill_engine_busy_pct"] - 10.0) < 1e-6
    assert d["decode_steps"] == 2 and d["decode_mean_batch"] == 5.0
    assert abs(d["decode_steps_busy_pct"] - 50.0) < 1e-6 and abs(d["decode_admit_busy_pct"] - 25.0) < 1e-6
    assert d["cpu_pct"] is None            # these registries serve no process CPU: "-", not 0%
    line = probe.worker_line(a)
    assert line.startswith("| p0 | prefill | 3 | 90% |") and line.count("|") == probe.WORKER_HEADER[1].count("|")
