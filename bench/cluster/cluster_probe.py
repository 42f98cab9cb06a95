"""Where a cluster replay's time went: the workers' own counters over one mode's run, and the GPU's
busy fraction sampled by ``nvidia-smi`` meanwhile (bench/cluster/cluster.py prints both under each mode).

``WorkerMeter.snapshot()`` reads every worker's /metrics (the gateway's Stats lists their URLs) and
keeps the totals this report needs: the prefill engine's seconds per request, the decode worker's
steps (count, seconds, batch sizes) and admissions (hand-offs rebuilt between steps, the batch waiting
meanwhile), and the shared chunks the decode worker found by source. The difference of two snapshots
is one run's share. ``GpuSampler`` runs ``nvidia-smi`` at a fixed period in the background: its
utilisation is the fraction of each period in which some kernel ran (any process), so 100% means the
GPU never went idle, not that it was used well.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import urllib.request

# metric name (Prometheus text, sample suffix included) -> key in a snapshot; label values join the key
WANTED = {
    "tessera_prefill_seconds_sum": "prefill_s", "tessera_prefill_seconds_count": "prefills",
    "tessera_prefill_queue_seconds_sum": "prefill_queue_s",
    "tessera_prefill_engine_seconds_total": "prefill_engine_s",
    "tessera_prefill_handoff_seconds_sum": "handoff_s",
    # the loading controller's recompute ratios (their mean: how much of the chunk tokens the prefills recomputed)
    "tessera_prefill_recompute_ratio_sum": "ratio_sum", "tessera_prefill_recompute_ratio_count": "ratios",
    "tessera_decode_step_seconds_sum": "step_s", "tessera_decode_step_seconds_count": "steps",
    "tessera_decode_batch_size_sum": "batch_rows",
    "tessera_decode_admit_seconds_sum": "admit_s", "tessera_decode_admit_seconds_count": "admits",
    "tessera_decode_chunks_total": "decode_chunks",
    # hand-offs sent back at admission to have evicted chunks read off the engine thread, and the chunks an admission
    # still read on it
    "tessera_decode_restaged_total": "restaged", "tessera_decode_admission_reads_total": "admission_reads",
    "tessera_prefill_handoffs_total": "handoffs",   # by transport: cuda-ipc, cuda-ipc-peer, nixl, grpc
    "process_cpu_seconds_total": "cpu_s",       # per role: WorkerMeter adds the role to the key
    # failed store calls (a lookup or get past its deadline: the shard is skipped for a moment, its chunks computed)
    "tessera_prefill_store_errors_total": "store_errors", "tessera_decode_store_errors_total": "store_errors",
}


def parse_metrics(text: str) -> dict[str, float]:
    """Totals of WANTED from one /metrics page; a labelled sample adds ``/<label value>`` to its key."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        key = WANTED.get(name)
        if key is None:
            continue
        if labels:
            key += "/" + ",".join(v.split("=", 1)[1].strip('"') for v in labels.rstrip("}").split(",") if "=" in v)
        out[key] = out.get(key, 0.0) + float(value)
    return out


class WorkerMeter:
    def __init__(self, client) -> None:
        self.client = client

    def snapshot(self) -> dict[str, float]:
        """Sums over every prefill and decode worker of the gateway's cluster; their processes' CPU seconds and
        their count by role (``cpu_s/<role>``, ``workers/<role>``); each worker's own figures under
        ``PER_WORKER<role>/<name>|<key>`` (``per_worker`` reads them); the gateway process's CPU seconds
        (``cpu_s/gateway``) where its Stats names its metrics."""
        total: dict[str, float] = {}
        stats = self.client.stats()
        for w in stats.workers:
            if w.role not in ("prefill", "decode") or not w.metrics_url:
                continue
            page = urllib.request.urlopen(w.metrics_url, timeout=10).read().decode()
            for k, v in parse_metrics(page).items():
                total[f"{PER_WORKER}{w.role}/{w.name}|{k}"] = v
                k = f"{k}/{w.role}" if k == "cpu_s" else k
                total[k] = total.get(k, 0.0) + v
            total[f"workers/{w.role}"] = total.get(f"workers/{w.role}", 0.0) + 1
        if getattr(stats, "metrics_url", ""):
            page = urllib.request.urlopen(stats.metrics_url, timeout=10).read().decode()
            total["cpu_s/gateway"] = parse_metrics(page).get("cpu_s", 0.0)
        return total


PER_WORKER = "w:"      # a snapshot key's prefix for one worker's own figure


def _per(a: float, b: float) -> float | None:
    return a / b if b else None


def _cell(row: dict, key: str, fmt: str = "{:.1f}") -> str:
    """A table cell: ``row[key]`` formatted, "-" where it is None (no such work in the run)."""
    v = row.get(key)
    return "-" if v is None else fmt.format(v)


def per_worker(d: dict[str, float], duration_s: float) -> list[dict]:
    """Each worker's share of a run from a snapshot delta, by role then name: requests prefilled and the prefill
    engine's busy share; decode steps, their mean batch and busy share, admissions' busy share; its process's CPU
    (100% = one core). An uneven split (routing, a slow GPU) shows here where the role's mean hides it."""
    seen: dict[tuple[str, str], dict[str, float]] = {}
    for key, v in d.items():
        if key.startswith(PER_WORKER):
            who, _, metric = key[len(PER_WORKER):].partition("|")
            role, _, name = who.partition("/")
            seen.setdefault((role, name), {})[metric] = v
    rows = []
    for (role, name), m in sorted(seen.items()):
        steps = m.get("steps", 0.0)
        rows.append({"role": role, "name": name, "prefills": m.get("prefills", 0.0),
                     "prefill_engine_busy_pct": _per(100 * m.get("prefill_engine_s", 0.0), duration_s),
                     "decode_steps": steps, "decode_mean_batch": _per(m.get("batch_rows", 0.0), steps),
                     "decode_steps_busy_pct": _per(100 * m.get("step_s", 0.0), duration_s),
                     "decode_admit_busy_pct": _per(100 * m.get("admit_s", 0.0), duration_s),
                     "cpu_pct": _per(100 * m["cpu_s"], duration_s) if "cpu_s" in m else None})
    return rows


WORKER_HEADER = ["| worker | role | requests prefilled | prefill engine busy | decode steps | mean batch "
                 "| decode in steps | decode admitting | process CPU |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]


def worker_line(r: dict) -> str:
    def f(key: str, fmt: str) -> str:
        return _cell(r, key, fmt)

    prefill, decode = r["role"] == "prefill", r["role"] == "decode"
    return (f"| {r['name']} | {r['role']} | {f('prefills', '{:.0f}') if prefill else ''} "
            f"| {f('prefill_engine_busy_pct', '{:.0f}%') if prefill else ''} "
            f"| {f('decode_steps', '{:.0f}') if decode else ''} | {f('decode_mean_batch', '{:.1f}') if decode else ''} "
            f"| {f('decode_steps_busy_pct', '{:.0f}%') if decode else ''} "
            f"| {f('decode_admit_busy_pct', '{:.0f}%') if decode else ''} | {f('cpu_pct', '{:.0f}%')} |")


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v if k.startswith("workers/") else v - before.get(k, 0.0) for k, v in after.items()}


def chunk_sources(d: dict[str, float]) -> dict[str, float]:
    """The decode worker's shared chunks by source, from a snapshot (or a delta)."""
    return {k.split("/", 1)[1]: v for k, v in d.items() if k.startswith("decode_chunks/")}


class GpuSampler:
    """``with GpuSampler() as g: ...``; then ``g.busy`` (mean utilisation % over every GPU the run's processes may
    use, None without nvidia-smi) and ``g.by_gpu`` (each one's)."""

    def __init__(self, period_ms: int = 100) -> None:
        self.period_ms = period_ms
        self.samples: list[float] = []
        self._proc = None
        self._reader = None

    def __enter__(self) -> "GpuSampler":
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return self
        import os

        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
        which = ["-i", visible] if visible else []
        self._proc = subprocess.Popen([exe, "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits",
                                       f"-lms={self.period_ms}", *which], stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            try:
                gpu, util = line.split(",")
                self.samples.append((gpu.strip(), float(util)))
            except ValueError:
                pass

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(5)
            self._reader.join(5)

    @property
    def busy(self) -> float | None:
        return sum(u for _, u in self.samples) / len(self.samples) if self.samples else None

    @property
    def by_gpu(self) -> dict[str, float]:
        seen: dict[str, list[float]] = {}
        for gpu, u in self.samples:
            seen.setdefault(gpu, []).append(u)
        return {gpu: sum(us) / len(us) for gpu, us in sorted(seen.items())}


def time_budget(d: dict[str, float], duration_s: float, gpu_busy: float | None) -> dict[str, float | None]:
    """One run's figures from a counter delta over ``duration_s`` seconds of replay."""
    steps, prefills, admits = d.get("steps", 0.0), d.get("prefills", 0.0), d.get("admits", 0.0)
    return {
        "duration_s": duration_s, "gpu_busy_pct": gpu_busy,
        "prefills": prefills, "prefill_mean_ms": _per(1e3 * d.get("prefill_s", 0.0), prefills),
        # the engine thread's own time (a request's prefill seconds overlap the next one's when pipelined)
        "prefill_engine_busy_pct": _per(100 * d.get("prefill_engine_s", d.get("prefill_s", 0.0)), duration_s),
        "handoff_mean_ms": _per(1e3 * d.get("handoff_s", 0.0), prefills),
        "recompute_ratio_mean": _per(d.get("ratio_sum", 0.0), d.get("ratios", 0.0)),
        "decode_steps": steps, "decode_mean_batch": _per(d.get("batch_rows", 0.0), steps),
        "decode_step_mean_ms": _per(1e3 * d.get("step_s", 0.0), steps),
        "decode_steps_busy_pct": _per(100 * d.get("step_s", 0.0), duration_s),
        "admits": admits, "admit_mean_ms": _per(1e3 * d.get("admit_s", 0.0), admits),
        "decode_admit_busy_pct": _per(100 * d.get("admit_s", 0.0), duration_s),
        # a worker process's CPU, in cores (100% = one core busy the whole run), averaged over the role's workers
        "prefill_cpu_pct": _per(100 * d.get("cpu_s/prefill", 0.0), duration_s * d.get("workers/prefill", 0.0)),
        "decode_cpu_pct": _per(100 * d.get("cpu_s/decode", 0.0), duration_s * d.get("workers/decode", 0.0)),
        "gateway_cpu_pct": _per(100 * d["cpu_s/gateway"], duration_s) if "cpu_s/gateway" in d else None,
        "store_errors": sum(v for k, v in d.items() if k.startswith("store_errors/")),
        "handoffs_by_transport": {k.split("/", 1)[1]: v for k, v in sorted(d.items()) if k.startswith("handoffs/")},
        "decode_restaged": d.get("restaged", 0.0), "decode_admission_reads": d.get("admission_reads", 0.0),
    }


def budget_line(mode: str, b: dict) -> str:
    def f(key: str, fmt: str = "{:.1f}") -> str:
        return _cell(b, key, fmt)

    return (f"| {mode} | {f('gpu_busy_pct', '{:.0f}%')} | {f('prefill_mean_ms')} | {f('prefill_engine_busy_pct', '{:.0f}%')} "
            f"| {f('recompute_ratio_mean', '{:.3f}')} | {f('handoff_mean_ms')} | {f('decode_steps', '{:.0f}')} | {f('decode_mean_batch')} "
            f"| {f('decode_step_mean_ms')} | {f('decode_steps_busy_pct', '{:.0f}%')} | {f('admit_mean_ms')} "
            f"| {f('decode_admit_busy_pct', '{:.0f}%')} | {f('prefill_cpu_pct', '{:.0f}%')} "
            f"| {f('decode_cpu_pct', '{:.0f}%')} | {f('gateway_cpu_pct', '{:.0f}%')} | {f('store_errors', '{:.0f}')} |")


BUDGET_HEADER = ["| mode | GPU busy (nvidia-smi) | prefill ms / request | prefill engine busy | mean recompute ratio "
                 "| hand-off ms / request "
                 "| decode steps | mean batch | step ms | decode in steps | admission ms / request | decode admitting "
                 "| prefill worker CPU | decode worker CPU | gateway CPU | failed store calls |",
                 "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
