"""What a decode step spends where: ``profile_calls(fn, reps)`` runs ``fn`` ``reps`` times under torch.profiler and
gives, per call, the ops by host (self) time and by GPU time, and the GPU's busy time (its kernels' and copies' sum;
kernels replayed in a CUDA graph count too)."""

from __future__ import annotations

import torch


def profile_calls(fn, reps: int, host_rows: int = 30, gpu_rows: int = 15) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    ops = prof.key_averages()

    def top(key, n):
        return [{"name": e.key, "calls": e.count / reps, "host_us": e.self_cpu_time_total / reps,
                 "gpu_us": e.self_device_time_total / reps} for e in sorted(ops, key=key)[:n]]

    return {"calls": reps, "gpu_busy_ms": sum(e.self_device_time_total for e in ops) / reps / 1e3,
            "host_self_ms": sum(e.self_cpu_time_total for e in ops) / reps / 1e3,
            "by_host": top(lambda e: -e.self_cpu_time_total, host_rows),
            "by_gpu": top(lambda e: -e.self_device_time_total, gpu_rows)}
