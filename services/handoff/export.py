"""Exporting a prefilled sequence as a ``Handoff`` (services/handoff/wire.py), on a prefill worker's engine thread.

The export runs around the first token: ``stage_export`` starts the few device-to-host copies it needs
(block tables, private slot positions, logits) before the token is sampled, whose read on the host
delivers them; ``export_sequence`` then works out the hand-off on the host and gathers the private K/V
into one buffer, with no sync when it stays on the device: the next request starts at once.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from services.engine.kv.block_table import host_to_device
from services.handoff.wire import ChunkRef, Handoff, LayerView, layer_views


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
    kv = layer_views(buf, counts, shape)
    for layer, i in enumerate(staged.layer_table):
        rows = slots[first[i]:first[i + 1]]
        torch.index_select(k_src[layer], 0, rows, out=kv[2 * layer])
        torch.index_select(v_src[layer], 0, rows, out=kv[2 * layer + 1])
    ready = None
    if not kv_on_device and buf.device.type != "cpu":
        buf = buf.cpu()  # one copy for every layer
        kv = layer_views(buf, counts, shape)
    elif buf.device.type == "cuda":
        ready = torch.cuda.Event()
        ready.record()
    layers = tuple(LayerView(views[i][1], views[i][0], kv[2 * layer], kv[2 * layer + 1])
                   for layer, i in enumerate(staged.layer_table))
    queries = () if seq.prefill_queries is None else seq.prefill_queries.export(len(seq.layer_tables))
    return Handoff(fingerprint, tuple(refs.values()), layers, seq.next_pos, staged.logits, kv=buf, ready=ready,
                   queries=queries)


_FLAT = weakref.WeakKeyDictionary()  # BlockPool -> its layers' K and V as flat views


def _flat_kv(pool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each layer's K and V as [N*BS, Hkv, D] views (made once per pool)."""
    if pool not in _FLAT:
        _FLAT[pool] = ([k.view(-1, *k.shape[2:]) for k in pool.k], [v.view(-1, *v.shape[2:]) for v in pool.v])
    return _FLAT[pool]


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
