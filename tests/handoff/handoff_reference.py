"""The hand-off export as it was before it was staged around the first token: the tests' oracle (and
bench/handoff/handoff_export.py's baseline). Device ops and host reads per table, one gather per layer."""

from __future__ import annotations

import torch

from services.handoff.wire import ChunkRef, Handoff, LayerView


def reference_export(fwd, seq, logits: torch.Tensor, fingerprint: str, kv_on_device: bool = False) -> Handoff:
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
        k, v = pool.k[layer][block, slot], pool.v[layer][block, slot]
        layers.append(LayerView(hidden, positions, k if kv_on_device else k.cpu(), v if kv_on_device else v.cpu()))
    return Handoff(fingerprint, tuple(refs.values()), tuple(layers), seq.next_pos, logits.float().cpu())


def _analyse(table, by_block, refs, seq, bits, pool, bs, dev):
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
    rows = torch.tensor(shared_rows, dtype=torch.long, device=dev)
    base = torch.tensor(shared_base, dtype=torch.long, device=dev)
    valid = bits[None, :] < torch.tensor(shared_len, dtype=torch.long, device=dev)[:, None]
    r, c = torch.nonzero(~vis[rows] & valid, as_tuple=True)
    hidden = (base[r] + c).cpu()
    rows = torch.tensor(priv_rows, dtype=torch.long, device=dev)
    r, slot = torch.nonzero(vis[rows], as_tuple=True)
    block = table.block_ids.long()[rows][r]
    positions = table.offsets.long()[rows][r] + pool.slot_pos[block, slot].long()
    return positions.cpu(), block, slot, hidden
