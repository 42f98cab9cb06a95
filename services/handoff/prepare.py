"""Getting a hand-off ready off the engine thread, so that admitting it stalls the batch least.

Parsing the hand-off, streaming the shared chunks this worker lacks from the KV store and copying
them to the GPU (a side stream) happen on a helper thread while the batch keeps decoding; the engine
thread then only writes the fetched layers into its pool (``Engine.import_handoff`` with a fetch that
serves them from memory). A chunk neither resident here nor in the store is computed by the engine
at admission (the slow case).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.cluster.kvio import StoreAccess
from services.engine.kv.loader import StreamedLayer
from services.handoff.transport import ReceivedHandoff
from services.tiers import Tier

if TYPE_CHECKING:
    import torch

    from services.handoff.imports import ImportLayout

    from services.handoff.wire import Handoff

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PreparedHandoff:
    """A received hand-off, parsed (``handoff``: services.engine.Handoff), with ``fetched[chunk_id]``
    = [StreamedLayer, ...] for the shared chunks streamed from the store."""

    received: ReceivedHandoff
    handoff: Handoff
    fetched: dict[str, list] = field(default_factory=dict)
    ready: torch.cuda.Event | None = None     # the fetched layers are on the device once it completes
    # where its chunks come from ("gpu": resident here, "host", "store", "computed" at admission), and how long
    # it waited for chunks the prefill worker was still writing (None: it did not wait): the decode worker's metrics
    sources: dict[str, int] = field(default_factory=dict)
    store_wait_s: float | None = None
    # a retrieval decode's shared chunks' indexes the store holds and the engine does not: {chunk id: (their bytes,
    # the chunk's length)}, fetched here so that the engine thread adopts them (``Engine.adopt_chunk_index``) without
    # a store round trip of its own
    chunk_indexes: dict[str, tuple[bytes, int]] = field(default_factory=dict)
    # the import's host-side layout (services/handoff/imports.import_layout), worked out here rather than on the
    # engine thread; None: the import makes it
    layout: ImportLayout | None = None
    # the shared chunks the engine held when this was prepared (so not read then), and those of them ``fetch_more``
    # found nowhere in the store since (the import computes them)
    held: frozenset[str] = frozenset()
    absent: set[str] = field(default_factory=set)
    # the events of chunks fetched later (``fetch_more``: evicted here between this preparation and the admission)
    later: list[torch.cuda.Event] = field(default_factory=list)

    def unstaged(self, resident) -> list[str]:
        """The shared chunks the engine held when this was prepared and no longer holds (``resident``: its cache),
        not fetched since nor found absent from the store: what its import would read from the store on the engine
        thread. (Chunks the preparation looked up and did not find are not among them: asking the store again
        off the engine thread would find them no sooner.)"""
        return [cid for cid in self.held if cid not in resident and cid not in self.fetched and cid not in self.absent]

    def adopt(self) -> None:
        """On the engine thread, before using ``fetched``: order its stream after the staging copies and
        tell the allocator the staged tensors are used there."""
        if self.ready is None and not self.later:
            return
        import torch

        stream = torch.cuda.current_stream()
        for ready in (self.ready, *self.later):
            if ready is not None:
                stream.wait_event(ready)
        for layers in self.fetched.values():
            for item in layers:
                item.k.record_stream(stream)
                item.v.record_stream(stream)


def prepare(received: ReceivedHandoff, engine, store: StoreAccess, store_wait_s: float = 0.0,
            index_store=None) -> PreparedHandoff:
    """``store_wait_s``: how long to wait for chunks the prefill worker is still writing to the store
    (the header's ``storing``) before leaving them to be computed at admission. ``index_store``: where chunks'
    retrieval indexes are kept (``kvio.ChunkIndexStore``), for a request decoded by retrieval: the indexes of its
    shared chunks are fetched from it here (``PreparedHandoff.chunk_indexes``)."""
    from services.handoff.imports import import_layout
    from services.handoff.wire import Handoff

    if received.header.kind != "engine":
        raise ValueError(f"unknown hand-off kind {received.header.kind!r}")
    handoff = Handoff.from_bytes(received.payload, received.kv)
    ids = list(dict.fromkeys(ref.chunk_id for ref in handoff.chunks))
    missing = [cid for cid in ids if cid not in engine.cache]   # a hint: the engine checks again at import
    present = store.lookup(missing) if missing and store.enabled else {}
    storing = set(received.header.storing)
    pending = [cid for cid in missing if cid not in present and cid in storing]
    waited = None
    if pending and store_wait_s > 0:
        t0 = time.monotonic()
        present.update(_await_writes(store, pending, store_wait_s))
        waited = time.monotonic() - t0
    fetched = _fetch(present, engine, store)
    from_host = sum(1 for cid in fetched if present[cid] == Tier.HOST)
    sources = {Tier.GPU.value: len(ids) - len(missing), Tier.HOST.value: from_host,
               "store": len(fetched) - from_host, Tier.COMPUTED.value: len(missing) - len(fetched)}
    fetched, ready = _stage(fetched, engine.device)
    indexes = {} if index_store is None else _chunk_indexes(handoff, engine, index_store)
    try:
        layout = import_layout(handoff)
    except Exception:  # noqa: BLE001 - a hand-off it cannot be made for fails at admission, as it always did
        layout = None
    return PreparedHandoff(received, handoff, fetched, ready, sources, waited, indexes, layout,
                           held=frozenset(cid for cid in ids if cid not in missing))


def _fetch(present: dict, engine, store: StoreAccess) -> dict[str, list]:
    """The chunks of ``present`` (a lookup's answer) read from the store: {chunk id: its layers} (a chunk whose read
    fails is left out: the engine computes it at admission). On a GPU, a chunk in this host's store arena is copied
    onto it and checked there (kvio.DeviceLayers), queued on a side stream: on the engine's it would wait behind its
    decode steps."""
    fetched: dict[str, list] = {}
    cuda = engine.device.type == "cuda"
    fetch = store.fetcher(present, engine.device)
    side = None
    if cuda:
        import torch

        from services.cluster.staging import side_stream

        side = side_stream(engine.device, "prepare")
    for cid in present:
        try:
            got = fetch(cid)
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                layers = list(got)
            if getattr(got, "verify", None) is not None:
                got.verify()        # here, off the engine thread: a chunk that fails is computed at admission
            if not cuda:      # views of the store's arena are copied now, not at admission
                layers = [StreamedLayer(i, *(t.clone() if store.in_arena(t) else t for t in (k, v)))
                          for i, k, v in layers]
            fetched[cid] = layers
        except Exception as exc:  # noqa: BLE001 - a broken stream: the engine computes the chunk instead
            log.warning("prefetch of chunk %s failed: %s", cid[:12], exc)
    return fetched


def fetch_more(prepared: PreparedHandoff, chunk_ids: list[str], engine, store: StoreAccess) -> int:
    """On a helper thread: read ``chunk_ids`` from the store into ``prepared`` (staged as ``prepare`` stages, their
    event in ``later``), for chunks the engine held when it was prepared and evicted before its admission. Returns how
    many were fetched (the rest, not in the store or failing, are computed at admission)."""
    present = store.lookup([cid for cid in chunk_ids if cid not in prepared.fetched]) if store.enabled else {}
    fetched, ready = _stage(_fetch(present, engine, store), engine.device)
    prepared.fetched.update(fetched)
    prepared.absent.update(cid for cid in chunk_ids if cid not in prepared.fetched)
    if ready is not None:
        prepared.later.append(ready)
    return len(fetched)


def _chunk_indexes(handoff, engine, index_store) -> dict[str, tuple[bytes, int]]:
    """The stored indexes of the hand-off's shared chunks that the engine does not keep (a store that fails leaves
    them to the engine, which fetches or builds them itself)."""
    out: dict[str, tuple[bytes, int]] = {}
    for ref in handoff.chunks:
        if ref.chunk_id in out or engine.holds_chunk_index(ref.chunk_id):
            continue
        try:
            blob = index_store.get(ref.chunk_id)
        except Exception as exc:  # noqa: BLE001 - the engine's own path stands behind this one
            log.warning("prefetch of chunk %s's index failed: %s", ref.chunk_id[:12], exc)
            continue
        if blob is not None:
            out[ref.chunk_id] = (blob, ref.length)
    return out


POLL_S = 0.02


def _await_writes(store: StoreAccess, ids: list[str], wait_s: float) -> dict[str, Tier]:
    """Poll the store until it holds ``ids`` or ``wait_s`` has passed; {chunk id: tier} of those it holds.
    Runs on the helper thread: the batch keeps decoding meanwhile."""
    t0 = time.monotonic()
    found: dict[str, Tier] = {}
    while True:
        found.update(store.lookup([cid for cid in ids if cid not in found]))
        if len(found) == len(ids) or time.monotonic() - t0 >= wait_s:
            break
        time.sleep(POLL_S)
    return found


def _stage(fetched: dict[str, list], device):
    """Fetched host layers -> device tensors copied off the engine's stream (``copy_aside``), so that
    admitting the sequence on the engine thread copies nothing; layers already on the device (read there and
    checked) are kept. Returns (fetched on the device, the event marking the copies done)."""
    if device.type != "cuda" or not fetched:
        return fetched, None
    import torch

    from services.cluster.staging import copy_aside

    order = [(cid, n) for cid, layers in fetched.items() for n, item in enumerate(layers) if not item.k.is_cuda]
    out: dict[str, list] = {cid: list(layers) for cid, layers in fetched.items()}
    if not order:
        ready = torch.cuda.Event()
        ready.record()          # after the device reads' copies (checked: they have landed)
        return out, ready
    flat, ready = copy_aside([t for cid, n in order for t in (fetched[cid][n].k, fetched[cid][n].v)], device)
    for j, (cid, n) in enumerate(order):
        out[cid][n] = StreamedLayer(fetched[cid][n].layer, flat[2 * j], flat[2 * j + 1])
    return out, ready
