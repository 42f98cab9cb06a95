"""bench/cluster/profile_summary.py finds the workers' named spans (services/engine/spans.py: "tessera.*") in a real
torch profiler trace, with the host syncs inside them."""

import importlib.util
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from services.engine.spans import span

_spec = importlib.util.spec_from_file_location(
    "profile_summary", Path(__file__).resolve().parents[1] / "bench" / "cluster" / "profile_summary.py")
summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(summary)


def test_named_spans_from_a_trace(tmp_path):
    """The workers' spans (services/engine/spans.py) land in a profiler's trace, and are no-ops without one."""
    x = torch.randn(64, 64)
    assert type(span("tessera.admit")).__name__ == "nullcontext"   # no profiler records: no dispatcher calls
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            with span("tessera.admit"):
                with span("tessera.import.chunks"):
                    x = x @ x / 64
            with span("tessera.step"):
                x = torch.tanh(x)
    trace = tmp_path / "t.json"
    prof.export_chrome_trace(str(trace))
    s = summary.summarize(summary.load(trace))
    assert {k: v["count"] for k, v in s["spans"].items()} == {
        "tessera.admit": 3, "tessera.import.chunks": 3, "tessera.step": 3}
    assert s["spans"]["tessera.admit"]["ms"] >= s["spans"]["tessera.import.chunks"]["ms"] > 0
    assert all(v["sync_ms"] == 0 for v in s["spans"].values())   # a CPU trace waits on no GPU


def test_syncs_inside_a_span_are_counted():
    def ev(name, ts, dur, cat="cpu_op"):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "tid": 1}

    events = [ev("tessera.admit", 0, 100, "user_annotation"), ev("aten::_to_copy", 10, 60),
              ev("cudaStreamSynchronize", 20, 40, "cuda_runtime"), ev("tessera.step", 200, 50, "user_annotation"),
              ev("cudaStreamSynchronize", 300, 5, "cuda_runtime")]
    s = summary.summarize(events)
    assert s["spans"]["tessera.admit"] == {"count": 1, "ms": 0.1, "sync_ms": 0.04}
    assert s["spans"]["tessera.step"]["sync_ms"] == 0    # the later sync lies outside every span


def test_a_py_spy_recording_is_summarised_by_process_role_and_thread(tmp_path):
    """bench/cluster/spy_summary.py: samples per process and thread, the process's role read off its stacks, and each
    thread's innermost frame of this repository."""
    spec = importlib.util.spec_from_file_location(
        "spy_summary", Path(__file__).resolve().parents[1] / "bench" / "cluster" / "spy_summary.py")
    spy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(spy)
    top = 'process 1:"python3 bench/cluster/cluster.py"'
    lines = [
        f'{top};process 7:"python3 -c spawn";thread (11): asyncio_2;_WorkItem.run (/x/lib/python3.12/concurrent/'
        'futures/thread.py:58);copy_out (/repo/services/handoff/cuda_ipc.py:123);rebuild_cuda_tensor (/x/'
        'site-packages/torch/multiprocessing/reductions.py:180) 6',
        f'{top};process 7:"python3 -c spawn";thread (12): decode-engine;Batcher._run (/repo/services/decode/'
        'batcher.py:132) 3',
        f'{top};process 8:"python3 -c spawn";thread (21): prefill-engine;EngineLoop._run (/repo/services/prefill/'
        'engine_loop.py:63) 4',
        "not a sample line",
    ]
    path = tmp_path / "gil.txt"
    path.write_text("\n".join(lines) + "\n")
    procs = spy.summarize(str(path))
    assert {pid: p["role"] for pid, p in procs.items()} == {"7": "decode", "8": "prefill"}
    assert procs["7"]["samples"] == 9 and dict(procs["7"]["threads"]) == {"asyncio_2": 6, "decode-engine": 3}
    assert dict(procs["7"]["frames"]["asyncio_2"]) == {"copy_out (services/handoff/cuda_ipc.py:123)": 6}


def test_a_py_spy_recording_of_one_process_is_summarised_as_that_process(tmp_path):
    """A recording of one worker (scale.sh's SPY_ROLE: no --subprocesses) names no process on its lines: they are all
    that process's samples, not none."""
    spec = importlib.util.spec_from_file_location(
        "spy_summary", Path(__file__).resolve().parents[1] / "bench" / "cluster" / "spy_summary.py")
    spy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(spy)
    path = tmp_path / "gil.txt"
    path.write_text("thread (21): prefill-engine;EngineLoop._run (/repo/services/prefill/engine_loop.py:63) 4\n"
                    "thread (22): kv-put_0;KVStoreClient.put (/repo/services/kvstore/client.py:339) 2\n")
    procs = spy.summarize(str(path))
    assert list(procs) == ["recorded"] and procs["recorded"]["role"] == "prefill"
    assert dict(procs["recorded"]["threads"]) == {"prefill-engine": 4, "kv-put_0": 2}
