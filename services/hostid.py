"""This machine's identity, as the services compare it: two processes with equal ids share a host (its GPUs for
CUDA IPC, its shared memory for the KV store's DRAM tier)."""

from __future__ import annotations

import socket
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def host_id() -> str:
    """Hostname plus the kernel's boot id (a container reuses a hostname)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
