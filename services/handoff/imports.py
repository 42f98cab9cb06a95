"""A hand-off rebuilt on the decode worker's engine (``import_sequence``): shared chunks from its cache, the store
or recompute, the private K/V written into new blocks (the format: ``wire.py``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from services.engine.spans import span
from services.handoff.wire import ChunkRef, Handoff, layer_views
from services.engine.kv.block_table import BlockTable, dense_run, host_to_device

log = logging.getLogger(__name__)


def import_layout(h: Handoff) -> ImportLayout:
    """What the import of ``h`` works out on the host from the hand-off alone (which private tokens each layer writes
    and shows): a decode worker's helper thread makes it while the batch decodes (services/handoff/prepare.py), and
    ``import_sequence`` takes it, so that the engine thread does not."""
    return ImportLayout(h)


def import_sequence(fwd, h: Handoff, fetch=None, layout: ImportLayout | None = None):
    """Rebuild a Sequence on this engine from a hand-off (chunks from cache, store or recompute). ``layout``:
    ``import_layout(h)``, made ahead (None: made here).

    The private tokens (every layer's positions, ascending) are laid densely over new blocks. Their
    slots, each layer's write rows and the tables are worked out on the host from the hand-off's
    host-side positions and hidden lists (``ImportLayout``) and reach the device in one copy; the private
    K/V of each run of layers that share one set of positions is then two indexed stores (one write a layer
    when their K/V are not views of one buffer). Nothing here waits for the GPU, unless a chunk is nowhere to
    be had and is computed. Named spans mark the shared chunks' part and the private part in a profile.
    """
    cache = fwd.cache
    if len(h.layers) != fwd.cfg.num_layers:
        raise ValueError(f"hand-off has {len(h.layers)} layers, this model {fwd.cfg.num_layers}")
    if layout is not None and layout.handoff is not h:
        raise ValueError("the import layout was made for another hand-off")
    pinned, private = [], []
    try:
        with span("tessera.import.chunks"):   # named spans in a TESSERA_TORCH_PROFILE trace
            for ref in h.chunks:
                pinned.append(_place_chunk(fwd, ref, fetch))
        with span("tessera.import.private"):
            return _import_private(fwd, h, pinned, private, layout)
    except BaseException:
        for e in pinned:
            cache.release(e)
        fwd.pool.free(private)
        raise


def _import_private(fwd, h: Handoff, pinned: list, private: list, layout: ImportLayout | None = None):
    """The private tokens' blocks (appended to ``private`` as they are taken), slots and K/V, and the Sequence."""
    from services.engine.decode import QueryTap
    from services.engine.request import Sequence

    cache, bs, dev = fwd.cache, fwd.bs, fwd.device
    layout = layout if layout is not None else ImportLayout(h)
    blocks = cache.allocate(-(-layout.n // bs), for_cache=False) if layout.n else []
    private += blocks
    on_dev = layout.to_device(h.chunks, pinned, blocks, bs, dev)
    if layout.n:
        fwd.pool.slot_pos[on_dev.block, on_dev.slot] = on_dev.pos
    kv = _device_kv(h, dev)
    for first, last in _runs(layout.write_of):   # layers [first, last) share one write set
        block, slot = on_dev.writes[layout.write_of[first]]
        if not block.numel():
            continue
        ks = _stacked([k for k, _ in kv[first:last]])
        vs = _stacked([v for _, v in kv[first:last]])
        if ks is not None and vs is not None:
            fwd.pool.write_layers(slice(first, last), block, slot, ks, vs)
        else:   # one layer, or layers apart in memory (stacking them would copy them): a write a layer
            for layer in range(first, last):
                fwd.pool.write(layer, block, slot, *kv[layer])
    tokens = {ref.chunk_id: list(ref.tokens) for ref in h.chunks}
    return Sequence([on_dev.tables[i] for i in layout.table_of], pinned, private, h.next_pos,
                    chunk_tokens=tokens, prefill_queries=QueryTap.of(h.queries) if h.queries else None)


def _runs(keys: list) -> list[tuple[int, int]]:
    """[first, last) of each run of equal consecutive keys."""
    runs, first = [], 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] != keys[first]:
            runs.append((first, i))
            first = i
    return runs


def _stacked(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """ts (one shape, dtype and device) as one [len(ts), *shape] view, when there are several and they lie equally
    spaced in one storage (a hand-off's layers, as ``layer_views`` cuts a received buffer); else None."""
    t0 = ts[0]
    if len(ts) < 2 or not all(t.untyped_storage().data_ptr() == t0.untyped_storage().data_ptr() and
                              t.shape == t0.shape and t.stride() == t0.stride() for t in ts):
        return None
    step = ts[1].storage_offset() - t0.storage_offset()
    if step <= 0 or any(t.storage_offset() != t0.storage_offset() + i * step for i, t in enumerate(ts)):
        return None
    return t0.as_strided((len(ts), *t0.shape), (step, *t0.stride()), t0.storage_offset())


def _place_chunk(fwd, ref: ChunkRef, fetch):
    """A shared chunk, pinned: resident here, else written from ``fetch`` (layers already on the device
    when the decode worker staged them; a read onto the GPU is verified first), else computed (a broken stream or
    a failed check falls back to that)."""
    entry = fwd.cache.acquire(ref.chunk_id)
    with span("tessera.import.fetch"):     # a store read this thread waits for, when the worker had not staged it
        layers = None if entry is not None or fetch is None else fetch(ref.chunk_id)
    if entry is None and layers is not None:
        try:
            verify = getattr(layers, "verify", None)
            if verify is not None:   # read onto the GPU and checked there (kvio.DeviceLayers): checked before use
                with span("tessera.import.verify"):     # waits for the copy and the check on the GPU
                    layers = list(layers)
                    verify()
            with span("tessera.import.insert"):
                entry = fwd.insert_chunk(ref.chunk_id, list(ref.tokens), layers)
        except Exception as exc:  # noqa: BLE001 - a broken stream or a failed check: the chunk is computed
            log.warning("writing fetched chunk %s failed, computing it: %s", ref.chunk_id[:12], exc)
            entry = None
    return entry if entry is not None else fwd.compute_chunk(ref.chunk_id, list(ref.tokens))


class ImportLayout:
    """Which private tokens each layer of a hand-off writes and shows, and which chunk tokens it hides,
    worked out on the host (numpy).

    pos int64 [n]: every layer's private positions, ascending (their slots: token i of a dense run);
    layers with equal positions share one write set (``write_of[layer]``: rows [P] into ``pos``), and
    layers with equal (hidden, positions) one table (``table_of[layer]``: (hidden [H], write set)).
    """

    def __init__(self, h: Handoff):
        self.handoff = h     # the hand-off it was made for (import_sequence checks it is given with that one)
        # NOTE: arrays are matched against the few distinct ones met so far rather than hashed as dict
        # keys: a comparison costs less than hashing a layer's bytes
        sets, hiddens, self.write_of = [], [], []
        for lv in h.layers:
            self.write_of.append(_index_of(sets, lv.positions.numpy()))
        self.pos = _sorted_unique(np.concatenate(sets)) if sets else np.zeros(0, dtype=np.int64)
        self.n = len(self.pos)
        self.rows = [np.searchsorted(self.pos, p) for p in sets]
        self.views, self.table_of, views = [], [], {}
        for lv, w in zip(h.layers, self.write_of):
            key = (_index_of(hiddens, lv.hidden.numpy()), w)
            if key not in views:
                views[key] = len(self.views)
                self.views.append((hiddens[key[0]].astype(np.int64, copy=False), w))
            self.table_of.append(views[key])

    def to_device(self, refs, entries, blocks: list[int], bs: int, dev: torch.device) -> "_OnDevice":
        """The tables and write slots of the sequence whose chunks are ``entries`` (pinned, one per ref)
        and private blocks ``blocks``, as views of one host-to-device copy.

        Entries of every table: each chunk's blocks (offset its start) in hand-off order, then the
        private blocks (offset 0): one block id and offset row shared by all tables, masks per table.
        """
        n, n_views = self.n, len(self.views)
        lengths = np.asarray([ref.length for ref in refs], dtype=np.int64)
        starts = np.asarray([ref.start for ref in refs], dtype=np.int64)
        n_blocks = np.asarray([len(e.blocks) for e in entries], dtype=np.int64)
        p_ids, _, _, p_block, p_slot = dense_run(blocks, n, bs)
        ids = np.concatenate([np.asarray([b for e in entries for b in e.blocks], dtype=np.int64), p_ids])
        n_shared = int(n_blocks.sum())
        e = len(ids)
        if not e:
            raise ValueError("a block table needs at least one entry")
        offs = np.concatenate([np.repeat(starts, n_blocks), np.zeros(len(p_ids), dtype=np.int64)])
        # a chunk token's index in entry order (entry = // BS, slot = % BS) is its position plus pad
        first = (np.cumsum(n_blocks) - n_blocks) * bs
        pad = first - starts
        chunk_slots = np.zeros(e * bs, dtype=bool)  # the chunks' token slots (their last blocks' padding not)
        chunk_slots[:n_shared * bs] = np.arange(n_shared * bs) - np.repeat(first, n_blocks * bs) \
            < np.repeat(lengths, n_blocks * bs)
        masks, visible = np.empty((n_views, e), dtype=np.int64), []
        for i, (hidden, w) in enumerate(self.views):
            shown = chunk_slots.copy()
            inside = (hidden >= starts[:, None]) & (hidden < (starts + lengths)[:, None])  # [chunks, H]
            c, j = np.nonzero(inside)
            shown[hidden[j] + pad[c]] = False
            shown[n_shared * bs + self.rows[w]] = True
            masks[i] = _mask_words(shown.reshape(e, bs))
            visible.append(int(np.count_nonzero(shown)))
        int32 = lambda a: np.asarray(a, dtype=np.int32)  # noqa: E731
        pos32 = np.zeros(-(-n // 2) * 2, dtype=np.int32)
        pos32[:n] = self.pos
        # int32 parts ride two to an int64 word: the device reads them as int32 views (no cast kernel)
        parts = [np.concatenate([int32(ids), int32(offs)]).view(np.int64), masks.reshape(-1),
                 *(a for r in self.rows for a in (p_block[r], p_slot[r])), p_block, p_slot, pos32.view(np.int64)]
        flat = host_to_device(np.concatenate(parts), torch.int64, dev)
        ids_offs = flat[:e].view(torch.int32)
        rows = flat[e:e + n_views * e].view(n_views, e)
        max_offset = max([int(s) for s, nb in zip(starts, n_blocks) if nb] + ([0] if n else []))
        tables = [BlockTable(ids_offs[:e], ids_offs[e:], rows[i], max_offset, visible[i],
                             host_rows=np.stack([ids, offs, masks[i]])) for i in range(n_views)]
        at, writes = e + n_views * e, []
        for r in self.rows:
            writes.append((flat[at:at + len(r)], flat[at + len(r):at + 2 * len(r)]))
            at += 2 * len(r)
        return _OnDevice(tables, writes, flat[at:at + n], flat[at + n:at + 2 * n],
                         flat[at + 2 * n:].view(torch.int32)[:n])


@dataclass(frozen=True, slots=True)
class _OnDevice:
    """An import's tables and slots on the device (views of one copy).

    tables: the distinct tables (``ImportLayout.table_of`` names each layer's); writes[w]: (block, slot)
    int64 [P] of write set w's tokens; block, slot int64 [n], pos int32 [n]: every private token's slot
    and position.
    """

    tables: list[BlockTable]
    writes: list[tuple[torch.Tensor, torch.Tensor]]
    block: torch.Tensor
    slot: torch.Tensor
    pos: torch.Tensor


def _index_of(seen: list[np.ndarray], a: np.ndarray) -> int:
    """The index of an array equal to ``a`` in ``seen``, which takes ``a`` when none is."""
    for i, b in enumerate(seen):
        if b.shape == a.shape and np.array_equal(b, a):
            return i
    seen.append(a)
    return len(seen) - 1


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    """np.unique by sorting (numpy's hashing unique is several times slower on a few thousand ints)."""
    a = np.sort(a)
    keep = np.ones(len(a), dtype=bool)
    keep[1:] = a[1:] != a[:-1]
    return a[keep]


def _mask_words(flags: np.ndarray) -> np.ndarray:
    """bool [E, BS] -> int64 [E]: bit t of entry i set where flags[i, t] (BS <= 64)."""
    bits = np.zeros((len(flags), 64), dtype=bool)
    bits[:, :flags.shape[1]] = flags
    return np.packbits(bits, axis=1, bitorder="little").view("<i8").reshape(-1).astype(np.int64, copy=False)


def _device_kv(h: Handoff, dev: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's private (k, v) [P, Hkv, D] on ``dev``: as they are when already there (a CUDA IPC
    hand-off's views of one buffer), else gathered into one pinned host buffer and copied over at once."""
    if h.ready is not None and dev.type == "cuda":  # exported by another thread of this process: after its gathers
        torch.cuda.current_stream(dev).wait_event(h.ready)
    pairs = [(lv.k, lv.v) for lv in h.layers]
    if all(k.device == dev and v.device == dev for k, v in pairs) or not pairs:
        return pairs
    parts = [t.reshape(-1) for kv in pairs for t in kv]
    host = torch.empty(sum(t.numel() for t in parts), dtype=parts[0].dtype, pin_memory=dev.type == "cuda")
    torch.cat([t.cpu() for t in parts], out=host)
    kv = layer_views(host.to(dev, non_blocking=True), [k.shape[0] for k, _ in pairs], pairs[0][0].shape[1:])
    return [(kv[2 * i], kv[2 * i + 1]) for i in range(len(pairs))]
