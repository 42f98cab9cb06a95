"""An opt-in torch-profiler window over a worker's engine loop, for finding where its time goes.

``TESSERA_TORCH_PROFILE=DIR[,START[,COUNT]]`` in a worker's environment (or ``TESSERA_TORCH_PROFILE_PREFILL``
/ ``_DECODE`` for one role, which wins over it): the worker's engine thread calls ``tick()`` once per unit
of work (a prefill request, a decode step); the profiler records units START .. START+COUNT-1 (defaults
64 and 32; one window at a time per process), host ops of every thread and the GPU's kernels and copies,
then (or when the worker stops inside the window) writes ``DIR/<name>-<pid>.json.gz`` (a Chrome trace:
chrome://tracing or ui.perfetto.dev) and ``DIR/<name>-<pid>.txt`` (the ops' totals). Unset, ``tick()``
costs one comparison. Workers of one benchmark each write their own files, so the prefill and decode
timelines can be laid side by side.
"""

from __future__ import annotations

import gzip
import logging
import os
import shutil
from pathlib import Path

from services import env

log = logging.getLogger(__name__)
ENV = "TESSERA_TORCH_PROFILE"
_ACTIVE: list = []          # the window recording in this process: torch runs one profiler per process


def parse(spec: str) -> tuple[Path, int, int]:
    """``DIR[,START[,COUNT]]`` -> (dir, start, count); ValueError naming the variable when malformed."""
    parts = [p.strip() for p in spec.split(",")]
    try:
        start = int(parts[1]) if len(parts) > 1 and parts[1] else 64
        count = int(parts[2]) if len(parts) > 2 and parts[2] else 32
    except ValueError:
        raise ValueError(f"{ENV} is DIR[,START[,COUNT]] with whole numbers; got {spec!r}") from None
    if not parts[0] or start < 0 or count < 1 or len(parts) > 3:
        raise ValueError(f"{ENV} is DIR[,START[,COUNT]] (START >= 0, COUNT >= 1); got {spec!r}")
    return Path(parts[0]), start, count


class ProfileWindow:
    def __init__(self, name: str, role: str, spec: str | None = None) -> None:
        if spec is None:
            spec = env.read(f"{ENV}_{role.upper()}") or env.read(ENV)
        self.name = name
        self.units = 0
        self._prof = None
        self.dir, self.start, self.count = parse(spec) if spec else (None, -1, 0)

    @property
    def enabled(self) -> bool:
        return self.dir is not None

    def tick(self) -> None:
        """Before a unit of work (engine thread)."""
        if self.dir is None:
            return
        if self.units == self.start:
            import torch
            from torch.profiler import ProfilerActivity, profile

            if _ACTIVE:           # workers sharing a process (tests, one machine): the first window only
                log.warning("%s: a torch profile is already recording in this process (%s); not profiling",
                            self.name, _ACTIVE[0].name)
                self.dir = None
                return
            _ACTIVE.append(self)
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._prof = profile(activities=acts, record_shapes=False, with_stack=False)
            self._prof.__enter__()
        elif self.units == self.start + self.count and self._prof is not None:
            self._write()
        self.units += 1

    def close(self) -> None:
        """Write a window the run ended inside of (engine thread; a worker calls it as it stops)."""
        if self._prof is not None:
            self._write()

    def _write(self) -> None:
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        _ACTIVE.remove(self)
        self.dir.mkdir(parents=True, exist_ok=True)
        stem = self.dir / f"{self.name}-{os.getpid()}"
        trace = stem.with_suffix(".json")
        prof.export_chrome_trace(str(trace))
        with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        trace.unlink()
        sort = "cuda_time_total" if any(e.device_type.name == "CUDA" for e in prof.events()) else "cpu_time_total"
        stem.with_suffix(".txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=60))
        log.info("%s: torch profile of units %d..%d written to %s.json.gz", self.name, self.start,
                 self.start + self.count - 1, stem)
