"""Prefill-to-decode hand-off: private KV and chunk ids only.

A decode worker rebuilds the request's view from a ``Handoff``: shared chunks come from its own
chunk cache, the KV store, or (last resort) are recomputed from the tokens carried here; only the
private KV (suffix, tokens recomputed by the blend step, and everything in modes that do not share
by content id) crosses the wire. Per layer, ``hidden`` lists the chunk tokens whose shared twins
are masked because a private, recomputed copy replaces them.

The export runs on a prefill worker's one engine thread, around the first token: ``stage_export``
starts the few device-to-host copies it needs (block tables, private slot positions, logits) before
the token is sampled, whose read on the host delivers them; ``export_sequence`` then works out the
hand-off on the host and gathers the private K/V into one buffer, with no sync when it stays on the
device: the next request starts at once.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from services.engine.block_table import BlockTable, host_to_device


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


@dataclass(frozen=True, slots=True)
class StagedExport:
    """What an export reads on the host, copied there before the first token is sampled (the sampling's
    own sync then delivers it, and the export after the first token waits for nothing).

    tables: the sequence's distinct block tables in first-use order; layer_table[l]: layer l's index in
    them; blocks int64 [B] sorted: the blocks that may hold private KV (the sequence's own and those of
    pinned entries not shared by content id); meta int64 (host): per table its block ids, offsets and
    masks [E] each, then the slot positions of ``blocks`` [B, BS]; logits fp32 [vocab] (host); ready: the
    CUDA event after those copies (None on the CPU).
    """

    tables: tuple
    layer_table: tuple[int, ...]
    blocks: np.ndarray
    meta: torch.Tensor
    logits: torch.Tensor
    ready: "torch.cuda.Event | None"


def stage_export(fwd, seq, logits: torch.Tensor) -> StagedExport:
    """Start copying what ``export_sequence`` reads on the host: a few launches, no sync."""
    tables, index, layer_table = [], {}, []
    for t in seq.layer_tables:
        if id(t) not in index:
            index[id(t)] = len(tables)
            tables.append(t)
        layer_table.append(index[id(t)])
    own = {*seq.private_blocks, *seq.gen_blocks, *(b for e in seq.pinned if e.kind != "chunk" for b in e.blocks)}
    blocks = np.asarray(sorted(own), dtype=np.int64)
    parts = []
    for t in tables:  # cat promotes int32 ids and offsets; tables built from rows keep their int64 twins
        parts += [t.id_rows[0], t.id_rows[1]] if t.id_rows is not None else [t.block_ids, t.offsets]
        parts.append(t.masks)
    parts.append(fwd.pool.slot_pos[host_to_device(blocks, torch.long, fwd.device)].reshape(-1))
    meta, logits, ready = torch.cat(parts), logits.float(), None
    if meta.device.type == "cuda":
        meta = torch.empty(meta.shape, dtype=meta.dtype, pin_memory=True).copy_(meta, non_blocking=True)
        logits = torch.empty(logits.shape, dtype=logits.dtype, pin_memory=True).copy_(logits, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
    return StagedExport(tuple(tables), tuple(layer_table), blocks, meta.cpu(), logits.cpu(), ready)


def export_sequence(fwd, seq, logits: torch.Tensor, fingerprint: str, kv_on_device: bool = False,
                    staged: StagedExport | None = None) -> Handoff:
    """Describe a prefilled sequence by chunk ids plus its private KV, layer by layer (copied to the
    CPU, or kept on the engine's device with ``kv_on_device``: for a transport that shares GPU memory,
    or to move it off the engine thread).

    ``staged``: from ``stage_export`` (made here when not given). Each distinct table is analysed once,
    on the host from its staged rows; every layer's private K/V are gathered straight into one buffer in
    ``Handoff.kv_buffer`` order: two launches a layer, and no sync when the K/V stay on the device.
    """
    pool, bs = fwd.pool, fwd.bs
    staged = staged or stage_export(fwd, seq, logits)
    if staged.ready is not None:
        staged.ready.synchronize()  # complete already when the first token was read on the host
    meta, at, views = staged.meta.numpy(), 0, []
    chunks = _ChunkBlocks([e for e in seq.pinned if e.kind == "chunk"], bs)
    slot_pos = meta[sum(3 * t.num_entries for t in staged.tables):].reshape(len(staged.blocks), bs)
    refs: dict[tuple[str, int], ChunkRef] = {}
    for t in staged.tables:
        rows = meta[at:at + 3 * t.num_entries].reshape(3, t.num_entries)
        at += 3 * t.num_entries
        views.append(_analyse(rows, chunks, staged.blocks, slot_pos, refs, seq, pool, bs))
    # private K/V, gathered straight into one buffer: layer by layer, K then V [P, Hkv, D]
    slots = host_to_device(np.concatenate([v[2] for v in views]), torch.long, fwd.device)
    first = np.cumsum([0] + [len(v[2]) for v in views]).tolist()
    counts = [len(views[i][2]) for i in staged.layer_table]
    k_src, v_src = _flat_kv(pool)
    shape = k_src[0].shape[1:]
    buf = torch.empty(2 * sum(counts) * shape.numel(), dtype=k_src[0].dtype, device=fwd.device)
    kv = _views(buf, counts, shape)
    for layer, i in enumerate(staged.layer_table):
        rows = slots[first[i]:first[i + 1]]
        torch.index_select(k_src[layer], 0, rows, out=kv[2 * layer])
        torch.index_select(v_src[layer], 0, rows, out=kv[2 * layer + 1])
    ready = None
    if not kv_on_device and buf.device.type != "cpu":
        buf = buf.cpu()  # one copy for every layer
        kv = _views(buf, counts, shape)
    elif buf.device.type == "cuda":
        ready = torch.cuda.Event()
        ready.record()
    layers = tuple(LayerView(views[i][1], views[i][0], kv[2 * layer], kv[2 * layer + 1])
                   for layer, i in enumerate(staged.layer_table))
    return Handoff(fingerprint, tuple(refs.values()), layers, seq.next_pos, staged.logits, kv=buf, ready=ready)


_FLAT = weakref.WeakKeyDictionary()  # BlockPool -> its layers' K and V as flat views


def _flat_kv(pool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each layer's K and V as [N*BS, Hkv, D] views (made once per pool)."""
    if pool not in _FLAT:
        _FLAT[pool] = ([k.view(-1, *k.shape[2:]) for k in pool.k], [v.view(-1, *v.shape[2:]) for v in pool.v])
    return _FLAT[pool]


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


class _ChunkBlocks:
    """Which shared chunk's block j a block id is: entry index and j of each, looked up by sorted search."""

    def __init__(self, entries, bs: int):
        self.entries = entries
        ids = np.asarray([b for e in entries for b in e.blocks], dtype=np.int64)
        order = np.argsort(ids, kind="stable")
        self.ids = ids[order]
        self.entry = np.repeat(np.arange(len(entries)), [len(e.blocks) for e in entries])[order]
        self.j = np.concatenate([np.arange(len(e.blocks)) for e in entries] or [np.zeros(0, np.int64)])[order]
        self.base = np.asarray([e.base for e in entries], dtype=np.int64)
        self.length = np.asarray([e.length for e in entries], dtype=np.int64)

    def find(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(bool [n]: a shared chunk's block, lookup row of each [n] (valid where True))."""
        if not len(self.ids):
            return np.zeros(len(blocks), dtype=bool), np.zeros(len(blocks), dtype=np.int64)
        at = np.minimum(np.searchsorted(self.ids, blocks), len(self.ids) - 1)
        return self.ids[at] == blocks, at


def _analyse(rows: np.ndarray, chunks: _ChunkBlocks, own: np.ndarray, slot_pos: np.ndarray, refs, seq, pool, bs):
    """(private positions int64 [P], hidden chunk positions int64 [H], each private position's slot in a
    layer's flat [N*BS] KV view [P]) of one table, from its rows [3, E] (block ids, offsets, masks)."""
    ids, offs, masks = rows
    bits = np.arange(bs, dtype=np.int64)
    vis = ((masks[:, None] >> bits) & 1).astype(bool)  # [E, BS]
    shared, at = chunks.find(ids)
    srow = np.flatnonzero(shared)
    which, j = chunks.entry[at[srow]], chunks.j[at[srow]]
    start = offs[srow] - chunks.base[which]
    for w, s in dict.fromkeys(zip(which.tolist(), start.tolist())):  # one ref per (chunk, start), in entry order
        key = chunks.entries[w].key
        if (key, s) not in refs:
            refs[key, s] = ChunkRef(key, s, tuple(seq.chunk_tokens[key]))
    # hidden: valid slots of shared entries whose bit is cleared (their recomputed twin is private)
    valid = bits[None, :] < np.minimum(bs, chunks.length[which] - j * bs)[:, None]
    r, c = np.nonzero(~vis[srow] & valid)
    hidden = (start + j * bs)[r] + c
    # private: every visible slot of the other entries, at offset + the position it was written at
    prow = np.flatnonzero(~shared)
    r, slot = np.nonzero(vis[prow])
    block = ids[prow][r]
    k = np.searchsorted(own, block)
    if len(block) and (k.max() >= len(own) or not np.array_equal(own[k], block)):
        # a block outside the sequence's own (none is, as tables are built): its positions from the device
        pos = pool.slot_pos[torch.from_numpy(block), torch.from_numpy(slot)].long().cpu().numpy()
    else:
        pos = slot_pos[k, slot]
    return torch.from_numpy(offs[prow][r] + pos), torch.from_numpy(hidden), block * bs + slot


def import_sequence(fwd, h: Handoff, fetch=None):
    """Rebuild a Sequence on this engine from a hand-off (chunks from cache, store or recompute)."""
    from services.engine.request import Sequence

    pool, cache, bs, dev = fwd.pool, fwd.cache, fwd.bs, fwd.device
    if len(h.layers) != fwd.cfg.num_layers:
        raise ValueError(f"hand-off has {len(h.layers)} layers, this model {fwd.cfg.num_layers}")
    pinned, private = [], []
    try:
        entries = []
        for ref in h.chunks:
            entry = cache.acquire(ref.chunk_id)
            layers = None if entry is not None or fetch is None else fetch(ref.chunk_id)
            if entry is None and layers is not None:
                try:
                    entry = fwd.insert_chunk(ref.chunk_id, list(ref.tokens), layers)
                except Exception:  # noqa: BLE001 - a broken stream falls back to computing the chunk
                    entry = None
            if entry is None:
                entry = fwd.compute_chunk(ref.chunk_id, list(ref.tokens))
            pinned.append(entry)
            entries.append(entry)
        all_pos = torch.unique(torch.cat([lv.positions for lv in h.layers])) if h.layers else torch.zeros(0, dtype=torch.long)
        all_pos = all_pos.to(dev)
        n = int(all_pos.numel())
        blocks = cache.allocate(-(-n // bs), for_cache=False) if n else []
        private += blocks
        block, slot = pool.slots_for(blocks, n)
        pool.slot_pos[block, slot] = all_pos.to(torch.int32)
        tables, memo = [], {}
        for layer, lv in enumerate(h.layers):
            pos = lv.positions.to(dev)
            idx = torch.searchsorted(all_pos, pos)
            pool.write(layer, block[idx], slot[idx], lv.k.to(dev), lv.v.to(dev))
            key = (lv.hidden.numpy().tobytes(), lv.positions.numpy().tobytes())
            if key not in memo:
                hid = lv.hidden.to(dev)
                tabs = []
                for ref, entry in zip(h.chunks, entries):
                    local = hid[(hid >= ref.start) & (hid < ref.start + ref.length)] - ref.start
                    hidden = torch.zeros(ref.length, dtype=torch.bool, device=dev)
                    hidden[local] = True
                    tabs.append(BlockTable.for_run(entry.blocks, ref.length, bs, ref.start, dev, hidden))
                if n:
                    visible = torch.zeros(n, dtype=torch.bool, device=dev)
                    visible[idx] = True
                    tabs.append(BlockTable.for_run(blocks, n, bs, 0, dev, ~visible))
                memo[key] = BlockTable.cat(tabs)
            tables.append(memo[key])
        tokens = {ref.chunk_id: list(ref.tokens) for ref in h.chunks}
        return Sequence(tables, pinned, private, h.next_pos, chunk_tokens=tokens)
    except BaseException:
        for e in pinned:
            cache.release(e)
        pool.free(private)
        raise
