"""The hand-off import as it was before its tables were built on the host: the tests' oracle (and
bench/handoff/handoff_import.py's baseline). Device ops per layer and per chunk, boolean-mask indexing (a sync
each on CUDA), one ``BlockTable.for_run`` per chunk and table."""

from __future__ import annotations

import torch

from services.engine.kv.block_table import BlockTable
from services.handoff.wire import Handoff


def reference_import(fwd, h: Handoff, fetch=None):
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
