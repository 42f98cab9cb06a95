"""Prefill-to-decode hand-off: private KV and chunk ids only.

A decode worker rebuilds the request's view from a ``Handoff``: shared chunks come from its own
chunk cache, the KV store, or (last resort) are recomputed from the tokens carried here; only the
private KV (suffix, tokens recomputed by the blend step, and everything in modes that do not share
by content id) crosses the wire. Per layer, ``hidden`` lists the chunk tokens whose shared twins
are masked because a private, recomputed copy replaces them.

A hand-off is made by ``services/engine/handoff_export.py`` (on the prefill worker) and rebuilt here
(``import_sequence``, on the decode worker).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import torch

from services.engine.block_table import BlockTable, dense_run, host_to_device


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """A shared chunk in a request: content id, global start, and its tokens (for recompute)."""

    chunk_id: str
    start: int
    tokens: tuple[int, ...]

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True, slots=True)
class LayerView:
    """What one layer sees besides the shared chunks.

    hidden int64 [H]: global positions of chunk tokens masked at this layer;
    positions int64 [P]: global positions of the private tokens visible at this layer;
    k, v [P, Hkv, D]: their KV (keys rotated at their global positions).
    """

    hidden: torch.Tensor
    positions: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True, slots=True)
class Handoff:
    model_fingerprint: str
    chunks: tuple[ChunkRef, ...]
    layers: tuple[LayerView, ...]
    next_pos: int
    logits: torch.Tensor  # [vocab] fp32, to sample the first token
    # every layer's K then V flat, when the layers' k/v are views of it in that order (kv_buffer() is it)
    kv: torch.Tensor | None = field(default=None, repr=False, compare=False)
    # CUDA event recorded on the exporting thread's stream once the K/V gathers are queued: another thread
    # that reads ``kv`` orders its own stream after it, not after whatever that stream queued since (the
    # next request's pass)
    ready: object = field(default=None, repr=False, compare=False)

    @property
    def private_bytes(self) -> int:
        return sum(lv.k.numel() * lv.k.element_size() * 2 for lv in self.layers)

    def kv_buffer(self) -> torch.Tensor:
        """Every layer's private K then V, flat in one tensor on their device (one allocation to share)."""
        if self.kv is not None:
            return self.kv
        parts = [t.reshape(-1) for lv in self.layers for t in (lv.k, lv.v)]
        if not parts:
            return torch.zeros(0)
        return torch.cat(parts)

    def to_bytes(self, with_kv: bool = True) -> bytes:
        """safetensors bytes: tensors plus a JSON header of the chunk refs. ``with_kv=False`` leaves the
        private K/V out (they travel apart, as ``kv_buffer()``; ``from_bytes`` takes them back)."""
        from safetensors.torch import save

        tensors = {"logits": self.logits.detach().float().cpu().contiguous()}
        kv = None
        if with_kv and self.kv is not None and self.layers:  # one copy to the host for every layer
            k = self.layers[0].k
            kv = _views(self.kv.detach().cpu(), [lv.k.shape[0] for lv in self.layers], k.shape[1:])
        for i, lv in enumerate(self.layers):
            for name in ("hidden", "positions", "k", "v") if with_kv else ("hidden", "positions"):
                t = getattr(lv, name) if kv is None or name in ("hidden", "positions") else kv[2 * i + (name == "v")]
                tensors[f"{i}.{name}"] = t.detach().cpu().clone()  # layers may share views
        meta = {"fingerprint": self.model_fingerprint, "next_pos": str(self.next_pos),
                "layers": str(len(self.layers)),
                "chunks": json.dumps([[c.chunk_id, c.start, list(c.tokens)] for c in self.chunks])}
        if self.layers:
            k = self.layers[0].k
            meta["kv"] = json.dumps([list(k.shape[1:]), str(k.dtype).removeprefix("torch.")])
        return save(tensors, metadata=meta)

    @staticmethod
    def from_bytes(data: bytes, kv_buffer: torch.Tensor | None = None) -> "Handoff":
        """The inverse of ``to_bytes``; ``kv_buffer``: the K/V a ``with_kv=False`` payload left out."""
        from safetensors.torch import load

        tensors = load(data)
        # the metadata travels in the safetensors header: u64 length, then JSON
        n = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8:8 + n]).get("__metadata__", {})
        if "fingerprint" not in meta:
            raise ValueError("not a Tessera hand-off: its header carries no model fingerprint")
        n_layers = int(meta["layers"])
        if kv_buffer is not None:
            tensors.update(_split_kv(kv_buffer, meta, [tensors[f"{i}.positions"].numel() for i in range(n_layers)]))
        missing = [i for i in range(n_layers) if f"{i}.k" not in tensors]
        if missing:
            raise ValueError(f"hand-off carries no K/V for layer {missing[0]} (and no separate buffer was given)")
        layers = tuple(LayerView(tensors[f"{i}.hidden"], tensors[f"{i}.positions"], tensors[f"{i}.k"], tensors[f"{i}.v"])
                       for i in range(n_layers))
        chunks = tuple(ChunkRef(c[0], int(c[1]), tuple(c[2])) for c in json.loads(meta["chunks"]))
        return Handoff(meta["fingerprint"], chunks, layers, int(meta["next_pos"]), tensors["logits"], kv=kv_buffer)


def _split_kv(buf: torch.Tensor, meta: dict, counts: list[int]) -> dict[str, torch.Tensor]:
    """Cut a ``kv_buffer()`` back into per-layer K and V [P, Hkv, D]; ValueError if it does not fit."""
    (hkv, dim), dtype = json.loads(meta["kv"])
    if str(buf.dtype).removeprefix("torch.") != dtype:
        raise ValueError(f"hand-off K/V buffer is {buf.dtype}, its header says {dtype}")
    want = 2 * sum(counts) * hkv * dim
    if buf.numel() != want:
        raise ValueError(f"hand-off K/V buffer holds {buf.numel()} values, its layers need {want}")
    out, at = {}, 0
    for i, p in enumerate(counts):
        for name in ("k", "v"):
            out[f"{i}.{name}"] = buf[at:at + p * hkv * dim].view(p, hkv, dim)
            at += p * hkv * dim
    return out


def _views(flat: torch.Tensor, counts: list[int], shape) -> list[torch.Tensor]:
    """K then V views [P, *shape] of each layer (P = counts[layer]) laid one after another in ``flat``;
    a few ops per run of layers with one P, not a few per layer."""
    runs = []  # (P, layers)
    for p in counts:
        if runs and runs[-1][0] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    out = []
    for (p, n), seg in zip(runs, flat.split([2 * p * n * shape.numel() for p, n in runs])):
        out += seg.view(2 * n, p, *shape).unbind(0)
    return out


def import_sequence(fwd, h: Handoff, fetch=None):
    """Rebuild a Sequence on this engine from a hand-off (chunks from cache, store or recompute).

    The private tokens (every layer's positions, ascending) are laid densely over new blocks. Their
    slots, each layer's write rows and the tables are worked out on the host from the hand-off's
    host-side positions and hidden lists (``_ImportLayout``) and reach the device in one copy; each
    layer's private K/V is then one indexed write. Nothing here waits for the GPU, unless a chunk is
    nowhere to be had and is computed.
    """
    from services.engine.request import Sequence

    cache, bs, dev = fwd.cache, fwd.bs, fwd.device
    if len(h.layers) != fwd.cfg.num_layers:
        raise ValueError(f"hand-off has {len(h.layers)} layers, this model {fwd.cfg.num_layers}")
    pinned, private = [], []
    try:
        for ref in h.chunks:
            pinned.append(_place_chunk(fwd, ref, fetch))
        layout = _ImportLayout(h)
        blocks = cache.allocate(-(-layout.n // bs), for_cache=False) if layout.n else []
        private += blocks
        on_dev = layout.to_device(h.chunks, pinned, blocks, bs, dev)
        if layout.n:
            fwd.pool.slot_pos[on_dev.block, on_dev.slot] = on_dev.pos
        for layer, (k, v) in enumerate(_device_kv(h, dev)):
            block, slot = on_dev.writes[layout.write_of[layer]]
            if block.numel():
                fwd.pool.write(layer, block, slot, k, v)
        tokens = {ref.chunk_id: list(ref.tokens) for ref in h.chunks}
        return Sequence([on_dev.tables[i] for i in layout.table_of], pinned, private, h.next_pos,
                        chunk_tokens=tokens)
    except BaseException:
        for e in pinned:
            cache.release(e)
        fwd.pool.free(private)
        raise


def _place_chunk(fwd, ref: ChunkRef, fetch):
    """A shared chunk, pinned: resident here, else written from ``fetch`` (layers already on the device
    when the decode worker staged them), else computed (a broken stream falls back to that)."""
    entry = fwd.cache.acquire(ref.chunk_id)
    layers = None if entry is not None or fetch is None else fetch(ref.chunk_id)
    if entry is None and layers is not None:
        try:
            entry = fwd.insert_chunk(ref.chunk_id, list(ref.tokens), layers)
        except Exception:  # noqa: BLE001 - a broken stream falls back to computing the chunk
            entry = None
    return entry if entry is not None else fwd.compute_chunk(ref.chunk_id, list(ref.tokens))


class _ImportLayout:
    """Which private tokens each layer of a hand-off writes and shows, and which chunk tokens it hides,
    worked out on the host (numpy).

    pos int64 [n]: every layer's private positions, ascending (their slots: token i of a dense run);
    layers with equal positions share one write set (``write_of[layer]``: rows [P] into ``pos``), and
    layers with equal (hidden, positions) one table (``table_of[layer]``: (hidden [H], write set)).
    """

    def __init__(self, h: Handoff):
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

    tables: the distinct tables (``_ImportLayout.table_of`` names each layer's); writes[w]: (block, slot)
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
    kv = _views(host.to(dev, non_blocking=True), [k.shape[0] for k, _ in pairs], pairs[0][0].shape[1:])
    return [(kv[2 * i], kv[2 * i + 1]) for i in range(len(pairs))]
