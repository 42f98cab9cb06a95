"""Layer-streamed chunk loading: a pass computes layer i while layer i+1 of a chunk is still arriving.

A ``ChunkLoad`` drains one chunk's layer iterator (from the KV store, layer 0 first) in a background
thread, writing each layer into the chunk's blocks as it lands. The forward pass calls
``LayerGate.wait(i)`` before it touches layer i: it returns as soon as every load has delivered layer i,
so fetching and computing overlap. A load that fails midway (store gone, checksum refused) is
recomputed from the chunk's tokens at the first wait that sees it: the request still gets right KV.

On a GPU the loads write on a side stream, so that their host-to-device copies overlap the pass's
kernels instead of queueing between them: the side stream starts after what the engine's stream had
queued when the load was made (the chunk's blocks may have just been freed by kernels still queued),
each layer records an event that ``LayerGate.wait`` makes the engine's stream wait for, and joining
a load makes the joining thread's stream wait for all of its writes.

A load whose layers are checked after they were handed over (``verify``: a chunk read from the store's
arena straight onto the GPU, its checksums computed there) is verified by the gate before any of its
layers is used: at the first ``wait``, at ``settled`` and at ``finish``. A failed check is a failed load:
the chunk is recomputed, so bytes that did not pass are never attended.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

_SIDE: dict[int, torch.cuda.Stream] = {}   # one load stream per GPU


LOCAL_SETTLE_S = 0.5   # the longest a pass waits for a load from host memory to land (milliseconds, normally)


class ChunkLoad(threading.Thread):
    """``local``: the layers come from this process's host memory (an iterator marked ``local = True``),
    so they all land within milliseconds: a pass waits for them rather than going on layer by layer.

    ``write_many(items)``, when given, writes every layer's [(layer, k, v), ...] at once (one batched
    copy); ``issue()`` then runs the load on the calling thread instead of ``start()`` in its own: a
    local chunk's copies take well under a millisecond to issue, and a loader thread per chunk would
    only contend with the engine thread for the interpreter."""

    def __init__(self, key: str, tokens: list[int], layers: Iterable, write: Callable, num_layers: int,
                 local: bool = False, write_many: Callable | None = None, verify: Callable[[], None] | None = None):
        super().__init__(name=f"chunk-load-{key[:8]}", daemon=True)
        self.key, self.tokens, self.layers, self.write = key, tokens, layers, write
        self.write_many = write_many
        self.local = local
        self.num_layers = num_layers
        self.delivered = 0           # layers 0..delivered-1 are in place
        self.error: BaseException | None = None
        self.recovered = False
        self.verify, self.verified = verify, verify is None   # verify(): raises unless the delivered bytes are right
        self.bytes = 0
        self.seconds = 0.0
        self.cond = threading.Condition()
        # GPU only (see the module's docstring): the side stream, when it may start, per-layer and last events
        self.stream = self.after = self.finished = None
        self.layer_done: list = []
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            dev = torch.cuda.current_device()
            self.stream = _SIDE.get(dev) or _SIDE.setdefault(dev, torch.cuda.Stream(dev))
            self.after = torch.cuda.Event()
            self.after.record()          # on the constructing (engine) thread's stream

    def run(self) -> None:
        t0 = time.perf_counter()
        side = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        try:
            with side:
                if self.stream is not None:
                    self.stream.wait_event(self.after)
                self._drain()
        except BaseException as exc:  # noqa: BLE001 - any failure means: recompute this chunk
            with self.cond:
                self.error = exc
                self.cond.notify_all()
        finally:
            if self.stream is not None:
                self.finished = torch.cuda.Event()
                self.finished.record(self.stream)
            self.seconds = time.perf_counter() - t0

    def issue(self) -> None:
        """Run the load on this thread, now (with ``write_many``): returns once its copies are queued."""
        self.run()

    def _drain(self) -> None:
        if self.write_many is not None:
            self._drain_at_once()
            return
        expect = 0
        for layer, k, v in self.layers:
            if layer != expect:
                raise ValueError(f"chunk {self.key[:12]}: layer {layer} arrived, {expect} expected")
            if layer >= self.num_layers:
                raise ValueError(f"chunk {self.key[:12]}: layer {layer} is past the model's {self.num_layers}")
            self.write(layer, k, v)
            if self.stream is not None:
                done = torch.cuda.Event()
                done.record(self.stream)
                self.layer_done.append(done)
            self.bytes += k.numel() * k.element_size() + v.numel() * v.element_size()
            expect += 1
            with self.cond:
                self.delivered = expect
                self.cond.notify_all()
        if expect != self.num_layers:
            raise ValueError(f"chunk {self.key[:12]}: stream ended after {expect} of {self.num_layers} layers")

    def _drain_at_once(self) -> None:
        items = list(self.layers)
        for expect, (layer, _, _) in enumerate(items):
            if layer != expect:
                raise ValueError(f"chunk {self.key[:12]}: layer {layer} arrived, {expect} expected")
        if len(items) != self.num_layers:
            raise ValueError(f"chunk {self.key[:12]}: {len(items)} layers came, the model has {self.num_layers}")
        self.write_many(items)
        if self.stream is not None:
            done = torch.cuda.Event()
            done.record(self.stream)
            self.layer_done = [done] * len(items)
        self.bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for _, k, v in items)
        with self.cond:
            self.delivered = len(items)
            self.cond.notify_all()

    def check(self) -> None:
        """Verify the delivered layers once (``verify``), now; a failure becomes the load's error (recomputed by the
        gate). Its time counts in the load's seconds."""
        if self.verified:
            return
        t0 = time.perf_counter()
        try:
            if self.error is None:
                self.verify()
        except BaseException as exc:  # noqa: BLE001 - any failure means: recompute this chunk
            with self.cond:
                self.error = exc
        finally:
            self.verified = True
            self.seconds += time.perf_counter() - t0

    def join(self, timeout: float | None = None) -> None:
        """Thread join (when it ran as one); then the caller's stream waits for every write of the load."""
        if self.ident is not None:
            super().join(timeout)
        if self.finished is not None and not self.is_alive():
            torch.cuda.current_stream().wait_event(self.finished)

    def ready(self, layer: int) -> None:
        """The caller's stream waits for layer ``layer``'s writes (delivered, on a GPU)."""
        if self.stream is not None and layer < len(self.layer_done):
            torch.cuda.current_stream().wait_event(self.layer_done[layer])


class LayerGate:
    """Waits for layer i of every load of one pass; recomputes loads that failed."""

    def __init__(self, loads: list[ChunkLoad], recompute: Callable[[ChunkLoad], None]):
        self.loads, self.recompute = loads, recompute
        self.wait_seconds = 0.0

    def wait(self, layer: int) -> None:
        t0 = time.perf_counter()
        for load in self.loads:
            with load.cond:
                load.cond.wait_for(lambda: load.delivered > layer or load.error is not None)
            load.check()
            if load.error is not None and not load.recovered:
                load.join()
                self.recompute(load)
                load.recovered = True
            elif load.error is None:
                load.ready(layer)
        self.wait_seconds += time.perf_counter() - t0

    def settled(self, timeout: float = 0.0) -> bool:
        """Whether every load has handed over all of its layers (or failed), waiting up to ``timeout``
        seconds for that (``LOCAL_SETTLE_S`` for loads from host memory): a pass may then stop waiting
        layer by layer (``finish()``) and run its remaining layers in one CUDA-graph replay. The time it
        stands waiting (for the layers, and for a checked-later load's checks) counts in ``wait_seconds``."""
        t0 = time.perf_counter()
        try:
            for load in sorted(self.loads, key=lambda ld: not ld.local):   # the bounded-by-LOCAL waits first
                deadline = t0 + (max(timeout, LOCAL_SETTLE_S) if load.local else timeout)
                with load.cond:
                    if not load.cond.wait_for(lambda: load.delivered == load.num_layers or load.error is not None,
                                              max(0.0, deadline - time.perf_counter())):
                        return False
                load.check()
            return True
        finally:
            self.wait_seconds += time.perf_counter() - t0

    def finish(self) -> None:
        """Join every load and recompute those that failed; the joins and checks count in ``wait_seconds`` (the
        recomputation does not: it is the pass's own work)."""
        for load in self.loads:
            t0 = time.perf_counter()
            load.join()
            load.check()
            self.wait_seconds += time.perf_counter() - t0
            if load.error is not None and not load.recovered:
                self.recompute(load)
                load.recovered = True

    @property
    def failed(self) -> int:
        return sum(1 for load in self.loads if load.error is not None)


@dataclass(frozen=True, slots=True)
class StreamedLayer:
    """One layer of a chunk's KV as it streams in (the KV store, a worker's host tier, a hand-off's fetched chunks):
    k and v [L, Hkv, D], keys at chunk-local positions. Unpacks as ``layer, k, v``."""

    layer: int
    k: torch.Tensor
    v: torch.Tensor

    def __iter__(self) -> Iterator:
        return iter((self.layer, self.k, self.v))


def numbered(pairs: Iterable) -> Iterator[StreamedLayer]:
    """A whole chunk given as [(k, v) of layer 0, (k, v) of layer 1, ...] as a stream."""
    for i, (k, v) in enumerate(pairs):
        yield StreamedLayer(i, k, v)


def as_layers(items: Iterable) -> Iterator[StreamedLayer]:
    """A fetch's stream, each item checked to be a ``StreamedLayer`` (a TypeError names what came instead)."""
    for item in items:
        if not isinstance(item, StreamedLayer):
            raise TypeError(f"a chunk stream yields StreamedLayer items, got {type(item).__name__}")
        yield item
