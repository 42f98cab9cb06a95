"""Programmatic dependent launch (PDL) across a layer's Triton kernels, on unless ``KernelOptions.pdl`` is off.

A short pass is a chain of ~9 kernels a layer; at each boundary the GPU drains (the last programs of one
kernel finish while SMs idle) and refills (the next kernel's programs are scheduled and run their prologue).
Launched as a programmatic dependent launch (CUDA >= sm_90, ``launch_pdl=True``), a kernel's programs may be
scheduled while the kernel before it in the stream is still running. Every kernel of the layer that takes
part has a ``PDL`` constexpr (default False); with it the program

  - may read, before anything else, only what no kernel of the pass writes: weights, norm weights, constant
    tables (inv_freq), and ask L2 for weight rows (the skinny GEMM's PDL_PREFETCH_STEPS);
  - then calls ``gdc_wait()`` (PTX griddepcontrol.wait) before its first read of anything a previous kernel
    may write (its inputs, the KV cache, the packed block table, positions, cos/sin) and before any write;
  - then calls ``gdc_launch_dependents()`` (griddepcontrol.launch_dependents), so the next kernel's programs
    may be scheduled and run their own prologue while this one computes (``enter``).

Why results are bit-identical with the switch off or on: griddepcontrol.wait blocks until every program of the
preceding grid has completed and its memory operations are visible to this grid, and a PDL kernel reads
nothing produced upstream (and writes nothing) before it. Kernels further back are covered by induction: the
kernel before could not complete before its own wait returned (every PDL kernel here waits), i.e. before the
one before it completed, and so on; a kernel that does not take part (cuBLAS, torch, a memcpy) is an ordinary
launch that started only after its predecessor completed. So at the wait every earlier kernel of the stream
has completed, and each kernel reads the same bytes as in a plainly ordered stream and runs the same
arithmetic on them (the PDL build adds two instructions and moves only loads of never-written data), so
every output is the same bits. Writes cannot race earlier readers either: they all come after the wait.
Only timing differs. (The skinny GEMM takes part in its one-split launches; split-K launches, which the
Llama-3-8B table does not pick at 64 rows, stay ordinary launches.)

It is on by default (``kernels/options.py``). Measured on an H100 (bench/pdl_stack/README.md; ``bench/engine/engine.py --backends
triton,triton:nopdl``, alternating in one process): the ``tessera@0`` pass 7.26-7.41 -> 6.97-6.98 ms with the same
logits, ``full`` and ``tessera@0.15`` unchanged within the spread; a decode step at batch 32 11.74 -> 11.08 ms,
at batch 8 7.62 -> 7.59 ms (``bench/decode/decode.py``). ``launch_kwargs`` says
whether a launch on a device takes part: the option on, compiled Triton (the interpreter has no PDL and
never gets it), a CUDA device of compute capability 9.0 or more. Triton 3.6 and later accept
``launch_pdl`` as a launch option and ``gdc_wait`` / ``gdc_launch_dependents`` from
``triton.language.extra.cuda``.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels.options import current

# Letting the next kernel be scheduled before the wait rather than after it measured no better on an H100 (the
# 32-layer chain 6.448 against 6.441 ms, tessera@0 7.4 against 7.3 ms: bench/pdl_stack/README.md) and was removed.
WAIT_FIRST = 1  # the PDL constexpr a participating kernel is compiled with (0: no PDL)
MIN_CAPABILITY = (9, 0)  # griddepcontrol: Hopper and later


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA device (cached per device index)."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def interpreted() -> bool:
    """True under Triton's interpreter (TRITON_INTERPRET=1), read at call time."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def active(device: torch.device) -> bool:
    """Whether a launch on ``device`` should be a programmatic dependent launch now."""
    if not current().pdl or interpreted() or device.type != "cuda":
        return False
    return capability(device) >= MIN_CAPABILITY


def mode() -> int:
    """The PDL constexpr of a participating launch."""
    return WAIT_FIRST


def launch_kwargs(device: torch.device) -> dict:
    """What a participating launcher adds to its kernel's launch: ``PDL=mode()`` (the kernel's constexpr) and
    ``launch_pdl=True`` (Triton's launch option) when ``active(device)``, else nothing (PDL keeps its default,
    False: the kernel compiles without griddepcontrol)."""
    return dict(PDL=mode(), launch_pdl=True) if active(device) else {}


@triton.jit
def enter(PDL: tl.constexpr):
    """A participating kernel's PDL point, after its reads of never-written data and before anything else: wait
    for the kernel before (griddepcontrol.wait), then let the next one be scheduled (launch_dependents); nothing
    when PDL is 0 / False."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
