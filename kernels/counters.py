"""Zeroed int32 arrival counters for kernels whose last program to arrive finishes a group's work (the skinny
GEMM's split-K reduce, the prefill attention's self-merging KV splits).

Each user keeps one ``ArrivalCounters`` pool: a buffer per device, made on first use outside CUDA-graph
capture (a tensor born in a capture belongs to the graph's pool) and kept zeroed by the kernels themselves
(the last arriver resets its group's counter). Launches sharing a pool must be ordered (one stream, as the
engine runs its layers); a CUDA graph captures the buffer's address and finds it zeroed at every replay. A
launch inside a capture before the buffer exists, or needing more counters than the pool holds, gets fresh
zeros of its own (one memset, captured with it).
"""

from __future__ import annotations

import torch


class ArrivalCounters:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.kept: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, n: int) -> torch.Tensor:
        """At least n zeroed int32 counters on ``device``."""
        kept = self.kept.get(device)
        if kept is None and n <= self.capacity and not (
                device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            kept = self.kept[device] = torch.zeros(self.capacity, dtype=torch.int32, device=device)
        if kept is not None and n <= kept.numel():
            return kept
        return torch.zeros(n, dtype=torch.int32, device=device)
