"""Chunk-aware routing: the prefill worker that already holds the request's chunks, unless busy.

Each prefill worker publishes the chunk ids resident in its device cache (with every prefill
reply and every status poll). A request scores each healthy worker by the fraction of its chunk
tokens already resident there, minus a load penalty per request in flight; the best score wins,
ties going to the less loaded worker, then in turn. With ``residency=False`` (an A/B's peer) the
resident tokens count for nothing: load alone, then in turn. Decode workers are picked by load alone.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field


@dataclass(slots=True)
class WorkerView:
    """What the gateway knows of one worker (updated by replies and polls)."""

    name: str
    role: str
    address: str
    healthy: bool = True
    in_flight: int = 0
    resident: frozenset[str] = field(default_factory=frozenset)
    metrics_url: str = ""
    gpu: tuple[str, str] | None = None  # (host id, device uuid) from its status: workers with one value share a GPU
    gone: str = ""                      # why it will not come back (Ray stopped restarting it); "" while it may


class NoWorker(RuntimeError):
    """No healthy worker of a role is known."""


class Router:
    """``colocate_bonus``: how many more requests in flight a decode worker on the prefill worker's GPU may have and
    still be picked over the least loaded one. A hand-off between workers of one GPU stays on the device (CUDA IPC);
    between GPUs it crosses the host, and a pair of H200s apart served a quarter of what one shared GPU did
    (bench/cluster/README.md)."""

    def __init__(self, load_penalty: float = 0.25, colocate_bonus: int = 8, residency: bool = True) -> None:
        if load_penalty < 0:
            raise ValueError(f"load_penalty must be >= 0, got {load_penalty}")
        if colocate_bonus < 0:
            raise ValueError(f"colocate_bonus must be >= 0, got {colocate_bonus}")
        self.load_penalty = load_penalty
        self.colocate_bonus = colocate_bonus
        self.residency = bool(residency)
        self.workers: dict[str, WorkerView] = {}
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def add(self, view: WorkerView) -> None:
        self.workers[view.name] = view

    def of_role(self, role: str) -> list[WorkerView]:
        return [w for w in self.workers.values() if w.role == role]

    def _candidates(self, role: str, avoid: set[str]) -> list[WorkerView]:
        """Healthy workers not tried yet for this request, else healthy ones tried before (back after a
        restart), else untried ones, else any: a request is refused only when the role has no worker."""
        workers = self.of_role(role)
        for pick in (lambda w: w.healthy and w.name not in avoid, lambda w: w.healthy,
                     lambda w: w.name not in avoid, lambda w: True):
            cands = [w for w in workers if pick(w)]
            if cands:
                return cands
        raise NoWorker(f"no {role} worker is configured")

    def ready(self) -> bool:
        """A healthy prefill and a healthy decode worker are known."""
        return all(any(w.healthy for w in self.of_role(role)) for role in ("prefill", "decode"))

    def gone(self) -> str:
        """Why no request can be served until an operator acts: every worker of a role is gone for good (the
        reasons), else ""."""
        for role in ("prefill", "decode"):
            workers = self.of_role(role)
            if workers and all(w.gone and not w.healthy for w in workers):
                return f"no {role} worker will serve: " + "; ".join(w.gone for w in workers)
        return ""

    def pick_prefill(self, chunk_ids: tuple[str, ...], chunk_lens: tuple[int, ...],
                     avoid: set[str] = frozenset()) -> WorkerView:
        total = sum(chunk_lens) or 1
        turn = next(self._turn)
        with self._lock:
            cands = self._candidates("prefill", avoid)
            n = len(cands)

            def score(iw: tuple[int, WorkerView]):
                i, w = iw
                resident = (sum(length for cid, length in zip(chunk_ids, chunk_lens) if cid in w.resident)
                            if self.residency else 0)
                return (resident / total - self.load_penalty * w.in_flight, -w.in_flight, -((i - turn) % n))

            best = max(enumerate(cands), key=score)[1]
            best.in_flight += 1
            return best

    def pick_decode(self, avoid: set[str] = frozenset(), near: WorkerView | None = None) -> WorkerView:
        """The least loaded decode worker, one on ``near``'s GPU (the prefill worker's) counted
        ``colocate_bonus`` requests lighter."""
        turn = next(self._turn)
        gpu = near.gpu if near is not None else None
        with self._lock:
            cands = self._candidates("decode", avoid)
            n = len(cands)

            def load(iw: tuple[int, WorkerView]):
                i, w = iw
                shared = gpu is not None and w.gpu == gpu
                return (w.in_flight - (self.colocate_bonus if shared else 0), not shared, (i - turn) % n)

            best = min(enumerate(cands), key=load)[1]
            best.in_flight += 1
            return best

    def done(self, view: WorkerView) -> None:
        with self._lock:
            view.in_flight = max(0, view.in_flight - 1)
