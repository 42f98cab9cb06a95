"""Prefill-to-decode hand-off: private KV and chunk ids only.

A decode worker rebuilds the request's view from a ``Handoff``: shared chunks come from its own
chunk cache, the KV store, or (last resort) are recomputed from the tokens carried here; only the
private KV (suffix, tokens recomputed by the blend step, and everything in modes that do not share
by content id) crosses the wire. Per layer, ``hidden`` lists the chunk tokens whose shared twins
are masked because a private, recomputed copy replaces them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from services.engine.block_table import BlockTable


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

    @property
    def private_bytes(self) -> int:
        return sum(lv.k.numel() * lv.k.element_size() * 2 for lv in self.layers)

    def kv_buffer(self) -> torch.Tensor:
        """Every layer's private K then V, flat in one tensor on their device (one allocation to share)."""
        parts = [t.reshape(-1) for lv in self.layers for t in (lv.k, lv.v)]
        if not parts:
            return torch.zeros(0)
        return torch.cat(parts)

    def to_bytes(self, with_kv: bool = True) -> bytes:
        """safetensors bytes: tensors plus a JSON header of the chunk refs. ``with_kv=False`` leaves the
        private K/V out (they travel apart, as ``kv_buffer()``; ``from_bytes`` takes them back)."""
        from safetensors.torch import save

        tensors = {"logits": self.logits.detach().float().cpu().contiguous()}
        for i, lv in enumerate(self.layers):
            for name in ("hidden", "positions", "k", "v") if with_kv else ("hidden", "positions"):
                tensors[f"{i}.{name}"] = getattr(lv, name).detach().cpu().clone()  # layers may share views
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
        return Handoff(meta["fingerprint"], chunks, layers, int(meta["next_pos"]), tensors["logits"])


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


def export_sequence(fwd, seq, logits: torch.Tensor, fingerprint: str, kv_on_device: bool = False) -> Handoff:
    """Describe a prefilled sequence by chunk ids plus its private KV, layer by layer (copied to the
    CPU, or kept on the engine's device with ``kv_on_device``: for a transport that shares GPU memory,
    or to move it off the engine thread).

    Layers share table objects (two distinct ones in a blend), so each distinct table is analysed once,
    with a few whole-table tensor ops; per layer only that layer's private KV is read.
    """
    pool, bs, dev = fwd.pool, fwd.bs, fwd.device
    by_block = {}
    for entry in seq.pinned:
        if entry.kind == "chunk":
            for j, b in enumerate(entry.blocks):
                by_block[b] = (entry, j)
    refs: dict[tuple[str, int], ChunkRef] = {}
    views: dict[int, tuple] = {}
    bits = torch.arange(bs, device=dev, dtype=torch.int64)
    layers = []
    for layer, table in enumerate(seq.layer_tables):
        if id(table) not in views:
            views[id(table)] = _analyse(table, by_block, refs, seq, bits, pool, bs, dev)
        positions, block, slot, hidden = views[id(table)]
        k, v = pool.read(layer, block, slot)
        layers.append(LayerView(hidden, positions, k if kv_on_device else k.cpu(), v if kv_on_device else v.cpu()))
    return Handoff(fingerprint, tuple(refs.values()), tuple(layers), seq.next_pos, logits.float().cpu())


def _analyse(table, by_block, refs, seq, bits, pool, bs, dev):
    """(private positions, their block and slot, hidden chunk positions) of one table."""
    ids, offs = table.block_ids.tolist(), table.offsets.tolist()
    shared_rows, shared_base, shared_len, priv_rows = [], [], [], []
    for e, b in enumerate(ids):
        if b in by_block:
            entry, j = by_block[b]
            start = offs[e] - entry.base
            refs.setdefault((entry.key, start), ChunkRef(entry.key, start, tuple(seq.chunk_tokens[entry.key])))
            shared_rows.append(e)
            shared_base.append(start + j * bs)
            shared_len.append(min(bs, entry.length - j * bs))
        else:
            priv_rows.append(e)
    vis = ((table.masks[:, None] >> bits) & 1).bool()  # [E, BS]
    # hidden: valid slots of shared entries whose bit is cleared (their recomputed twin is private)
    rows = torch.tensor(shared_rows, dtype=torch.long, device=dev)
    base = torch.tensor(shared_base, dtype=torch.long, device=dev)
    valid = bits[None, :] < torch.tensor(shared_len, dtype=torch.long, device=dev)[:, None]
    r, c = torch.nonzero(~vis[rows] & valid, as_tuple=True)
    hidden = (base[r] + c).cpu()
    # private: every visible slot of the other entries, at offset + the position it was written at
    rows = torch.tensor(priv_rows, dtype=torch.long, device=dev)
    r, slot = torch.nonzero(vis[rows], as_tuple=True)
    block = table.block_ids.long()[rows][r]
    positions = table.offsets.long()[rows][r] + pool.slot_pos[block, slot].long()
    return positions.cpu(), block, slot, hidden


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
