"""The options kernel launches read: one frozen object, set for a stretch of work, never a module switch.

A caller that owns a GPU's work (the engine) builds a ``KernelOptions`` once and runs its passes, steps and graph
captures inside ``using(options)``; the launchers here read ``current()`` when they launch. A CUDA graph captured
inside ``using`` keeps what that launch chose, so its owner records the options it was captured with (the
engine's options are frozen: there is nothing to flip after the warm-up). The value is a ``ContextVar``: a
thread that sets none launches with the defaults, and two engines in one process (tests, benchmarks) never see
each other's.

Each field is a default that won its A/B on every device measured, kept switchable only where it is the peer a
benchmark compares against (bench/pdl_stack/README.md, bench/skinny_gemm/README.md).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KernelOptions:
    """pdl: a layer's Triton kernels launch as programmatic dependent launches where the device allows it (sm_90+,
    compiled Triton; kernels/pdl.py); off, every launch is an ordinary one (the same bits).
    tma: the skinny GEMM's table entries that name TMA read by tensor descriptors where the device allows it
    (kernels/linear/tma.py); off, every entry streams by pointer loads (the same bits)."""

    pdl: bool = True
    tma: bool = True

    def __post_init__(self) -> None:
        for name in ("pdl", "tma"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"KernelOptions.{name} must be True or False, got {value!r}")


DEFAULT = KernelOptions()
_CURRENT: contextvars.ContextVar[KernelOptions] = contextvars.ContextVar("kernel_options", default=DEFAULT)


def current() -> KernelOptions:
    """The options launches made now read (``DEFAULT`` outside any ``using``)."""
    return _CURRENT.get()


@contextmanager
def using(options: KernelOptions) -> Iterator[KernelOptions]:
    """Launches inside the block (on this thread) read ``options``; the previous value comes back after."""
    if not isinstance(options, KernelOptions):
        raise TypeError(f"using() takes a KernelOptions, got {type(options).__name__}")
    token = _CURRENT.set(options)
    try:
        yield options
    finally:
        _CURRENT.reset(token)
