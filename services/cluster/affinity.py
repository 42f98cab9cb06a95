"""A GPU worker's threads on the CPUs of its GPU's NUMA node.

Every byte a worker moves between host and GPU (a chunk's layers read from the store's shared-memory arena or its
host tier, a hand-off's helpers, pinned staging) crosses the GPU's PCIe root, which belongs to one socket of a
multi-socket host; so does every launch of its engine thread. Left to the scheduler, a worker process sits wherever it
is put: on a host of two sockets it may run, and place the pinned memory it touches, on the far one. A worker
binds itself, every thread, to the CPUs sysfs names local to its GPU before its engine allocates host memory, so that
pinned buffers it touches first land on that node too. The four-H200 hosts lent for bench/cluster have one socket
and one NUMA node (every CPU local to every GPU): there it binds nothing, and what it gains on two sockets is not
measured.

Where the host says nothing (no sysfs entry, a single node: every CPU is local) or the allowed CPUs (a container's
cpuset) share none with the GPU's node, nothing changes and ``bind_to_gpu`` says why.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

SYSFS_PCI = Path("/sys/bus/pci/devices")


def parse_cpulist(text: str) -> frozenset[int]:
    """The CPUs of a kernel cpulist ("0-31,64-95", "3", ""). ValueError on anything else."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"not a cpulist: {text!r}")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"not a cpulist: {text!r} ({part} runs backwards)")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def pci_address(device) -> str:
    """The PCI address sysfs names a CUDA device by ("0000:18:00.0"); "" when torch does not say."""
    import torch

    props = torch.cuda.get_device_properties(device)
    ids = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if any(i is None for i in ids):
        return ""
    return f"{ids[0]:04x}:{ids[1]:02x}:{ids[2]:02x}.0"


def local_cpus(address: str, sysfs: Path = SYSFS_PCI) -> frozenset[int]:
    """The CPUs local to the PCI device at ``address`` (its ``local_cpulist``); empty when sysfs has no entry."""
    try:
        return parse_cpulist((sysfs / address / "local_cpulist").read_text())
    except (OSError, ValueError):
        return frozenset()


def bind_threads(cpus: frozenset[int]) -> int:
    """Every thread of this process, and those it starts after (they inherit their creator's), on ``cpus``.
    Returns how many threads were bound (a thread that ended meanwhile is skipped)."""
    bound = 0
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
            bound += 1
        except ProcessLookupError:
            continue
    return bound


def bind_to_gpu(device, sysfs: Path = SYSFS_PCI) -> str:
    """Bind this process to its GPU's local CPUs (those also allowed to it); returns what was done, or why not, for
    the worker's log."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return f"not bound: {device} is no GPU"
    if not hasattr(os, "sched_setaffinity"):
        return "not bound: this system sets no CPU affinity"
    address = pci_address(device)
    if not address:
        return "not bound: torch gives no PCI address for the GPU"
    local = local_cpus(address, sysfs)
    allowed = frozenset(os.sched_getaffinity(0))
    if not local:
        return f"not bound: sysfs names no CPUs local to {address}"
    cpus = local & allowed
    if not cpus:
        return f"not bound: none of the {len(local)} CPUs local to {address} is allowed to this process"
    if cpus == allowed:
        return f"not bound: every CPU allowed ({len(allowed)}) is local to {address}"
    try:
        threads = bind_threads(cpus)
    except OSError as exc:      # refused (a sandbox's seccomp, a cpuset changed meanwhile): the worker serves as placed
        with contextlib.suppress(OSError):
            bind_threads(allowed)       # the threads bound before the refusal back where they were
        return f"not bound: binding to the CPUs local to {address} was refused ({exc})"
    return f"{threads} threads bound to the {len(cpus)} CPUs local to {address} (of {len(allowed)} allowed)"
