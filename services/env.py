"""Every environment variable Tessera reads, in one table, read through one function.

Workers read theirs once, at start (``EngineOptions.from_env`` in ``EngineSettings.load``, the profiler's window
in ``ProfileWindow``); the command-line tools read theirs for defaults. README.md's table "Environment
variables" lists the same rows (a test keeps the two equal). Nothing else in the project reads ``os.environ``
for a ``TESSERA_`` name.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Variable:
    name: str
    default: str | None       # None: unset means off / not given
    read_by: str
    meaning: str


VARIABLES: tuple[Variable, ...] = (
    Variable("TESSERA_PDL", "1", "workers", "0: no Triton kernel launches as a programmatic dependent launch "
             "(EngineOptions.kernels.pdl)"),
    Variable("TESSERA_TMA", "1", "workers", "0: the skinny GEMM streams every table entry by pointer loads "
             "(EngineOptions.kernels.tma)"),
    Variable("TESSERA_SKINNY_GEMM", "1", "workers", "0: every projection on cuBLAS, none on the skinny Triton GEMM "
             "(EngineOptions.skinny_gemm)"),
    Variable("TESSERA_REUSE_GRAPH", "1", "workers", "0: ratio-0 reuse passes through the general static tail, not "
             "one copy and one replay (EngineOptions.reuse_graph)"),
    Variable("TESSERA_BLEND_GRAPH", "1", "workers", "0: CacheBlend passes through the general path, not one copy and "
             "one graph (EngineOptions.blend_graph)"),
    Variable("TESSERA_TORCH_PROFILE", None, "workers", "DIR[,START[,COUNT]]: a torch-profiler window over the engine "
             "loop (services/cluster/profiling.py)"),
    Variable("TESSERA_TORCH_PROFILE_PREFILL", None, "prefill workers", "as TESSERA_TORCH_PROFILE, for prefill workers "
             "only (wins over it)"),
    Variable("TESSERA_TORCH_PROFILE_DECODE", None, "decode workers", "as TESSERA_TORCH_PROFILE, for decode workers "
             "only (wins over it)"),
    Variable("TESSERA_STATE", None, "tessera up / down / status", "the file naming the running cluster (default "
             "~/.tessera/cluster.json)"),
    Variable("TESSERA_TOKEN", None, "tessera up, tessera-loadgen", "the bearer token clients send (default of "
             "--token)"),
)
BY_NAME = {v.name: v for v in VARIABLES}
FLAGS = ("0", "1")


def read(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The variable's value in ``environ`` (default: this process's), else its default. KeyError for a name
    the table does not list: every variable read is documented."""
    var = BY_NAME[name]
    value = (os.environ if environ is None else environ).get(name)
    return var.default if value is None or value == "" else value


def flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """A 0 / 1 variable; ValueError naming it for anything else."""
    value = read(name, environ)
    if value not in FLAGS:
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"
