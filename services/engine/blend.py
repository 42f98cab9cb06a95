"""The blend step: reuse cached chunk KV and recompute only what cross-chunk attention changes.

Layout of one reuse request: chunks placed from position 0 in the given order, then the suffix.
  ratio 0   : only the suffix is computed; it attends to every chunk's cached KV (Block-Attention).
  ratio > 0 : layers before the check layer are computed for every token (layer 0 reads the cache:
              its KV depends on the token alone, so cached == fresh); at the check layer the fresh K/V
              of every chunk token is compared with the cached copy and the top ``ratio`` of tokens by
              deviation (HKVD) are kept; from there on only they and the suffix are computed.
Recomputed tokens get private slots at their global positions, and their shared twins are hidden by
the entries' slot masks: no shared block is copied or written (``copy=False``). ``copy=True`` is
CacheBlend as published: each chunk's KV is first copied and re-rotated to its global position and the
recomputed tokens overwrite their copies.
Causality is by global position in every kernel, so a recomputed token never sees a later token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kernels.rope import rope_cos_sin, rotate
from services.engine.block_table import BlockTable, host_to_device
from services.engine.request import PlacedChunk, Sequence

DEVIATION_METRICS = ("k", "v", "kv")


@dataclass(frozen=True, slots=True)
class BlendConfig:
    check_layer: int = 1
    deviation: str = "kv"   # which fresh-vs-cached difference ranks tokens: k (post-RoPE), v, or both

    def __post_init__(self) -> None:
        if self.check_layer < 0:
            raise ValueError(f"check_layer must be >= 0, got {self.check_layer}")
        if self.deviation not in DEVIATION_METRICS:
            raise ValueError(f"deviation must be one of {DEVIATION_METRICS}, got {self.deviation!r}")


def select_hkvd(k_fresh, v_fresh, k_cached, v_cached, n_keep: int, metric: str) -> torch.Tensor:
    """Indices (ascending) of the n_keep tokens whose fresh KV deviates most from the cache.

    All tensors [N, Hkv, D]; deviation is the squared L2 distance summed over heads, in fp32.
    """
    dev = torch.zeros(k_fresh.shape[0], dtype=torch.float32, device=k_fresh.device)
    if metric in ("k", "kv"):
        dev += (k_fresh.float() - k_cached.float()).pow(2).sum(dim=(1, 2))
    if metric in ("v", "kv"):
        dev += (v_fresh.float() - v_cached.float()).pow(2).sum(dim=(1, 2))
    if n_keep >= dev.numel():
        return torch.arange(dev.numel(), device=dev.device)
    return torch.topk(dev, n_keep, sorted=False).indices.sort().values


class ChunkLayout:
    """Where each chunk token of a request lives: its global position and its cached slot."""

    def __init__(self, placed: list[PlacedChunk], block_size: int, device: torch.device):
        pos, block, slot, rot, owner = [], [], [], [], []
        for i, p in enumerate(placed):
            n = p.entry.length
            idx = torch.arange(n, device=device)
            blocks = host_to_device(p.entry.blocks, torch.long, device)
            pos.append(p.start + idx)
            block.append(blocks[idx // block_size])
            slot.append(idx % block_size)
            rot.append(torch.full((n,), p.rot, dtype=torch.long, device=device))
            owner.append(torch.full((n,), i, dtype=torch.long, device=device))
        self.placed = placed
        self.pos = torch.cat(pos)        # [N] global positions
        self.block = torch.cat(block)    # [N] cached block of each token
        self.slot = torch.cat(slot)      # [N]
        self.rot = torch.cat(rot)        # [N] RoPE offset from cached to global position
        self.owner = torch.cat(owner)    # [N] index of the chunk in ``placed``

    @property
    def num_tokens(self) -> int:
        return int(self.pos.numel())

    def shared_tables(self, block_size: int, device, hidden: torch.Tensor | None = None) -> list[BlockTable]:
        """One table per chunk (offset = rot), hiding tokens where ``hidden`` [N] is set."""
        tables, start = [], 0
        for p in self.placed:
            n = p.entry.length
            h = None if hidden is None else hidden[start:start + n]
            tables.append(BlockTable.for_run(p.entry.blocks, n, block_size, p.rot, device, h))
            start += n
        return tables

    def cached_kv(self, pool, layer: int, inv_freq) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached K (rotated to global positions, in the cache dtype) and V of every chunk token."""
        k, v = pool.read(layer, self.block, self.slot)
        cos, sin = rope_cos_sin(self.rot, inv_freq)
        return rotate(k, cos[:, None, :], sin[:, None, :]), v


def blend_pass(fwd, placed, chunks, pinned, private, suffix, mode, ratio, blend: BlendConfig, stats):
    """Reuse pass over placed chunks (tessera, blend_copy, position_aware) -> (logits, Sequence)."""
    dev, bs, n_layers = fwd.device, fwd.bs, fwd.cfg.num_layers
    t0 = time.perf_counter()
    lay = ChunkLayout(placed, bs, dev)
    n_chunk = lay.num_tokens
    pos_s = torch.arange(n_chunk, n_chunk + len(suffix), device=dev)
    s_blocks, s_block, s_slot, s_table = fwd._private(pos_s)
    private += s_blocks
    copy = mode == "blend_copy"
    if copy:
        if fwd._gate is not None:
            fwd._gate.finish()  # the copy needs every layer before it starts
        # CacheBlend as published: copy every chunk's KV, keys re-rotated to the global position
        c_blocks, c_block, c_slot, c_table = fwd._private(lay.pos)
        private += c_blocks
        stats.copied_blocks = len(c_blocks)
        cos, sin = rope_cos_sin(lay.rot, fwd.model.inv_freq)
        for layer in range(n_layers):
            k, v = fwd.pool.read(layer, lay.block, lay.slot)
            fwd.pool.write(layer, c_block, c_slot, rotate(k, cos[:, None, :], sin[:, None, :]), v)
        base = BlockTable.cat([c_table, s_table])
    else:
        base = BlockTable.cat(lay.shared_tables(bs, dev) + [s_table])
    ids_s = host_to_device(suffix, torch.long, dev)

    if ratio == 0.0:
        tables = [base] * n_layers
        logits = fwd._run(ids_s, pos_s, tables, s_block, s_slot)
    else:
        ids_c = host_to_device([t for c in chunks for t in c], torch.long, dev)
        logits, tables = _blend_layers(fwd, lay, ids_c, ids_s, pos_s, s_block, s_slot, s_table, base,
                                            copy, c_block if copy else None, c_slot if copy else None,
                                            ratio, blend, private, stats)
    stats.private_blocks_allocated += len(private)
    stats.forward_seconds = time.perf_counter() - t0
    tokens = {p.entry.key: c for p, c in zip(placed, chunks)}
    return logits, Sequence(tables, pinned, private, n_chunk + len(suffix), chunk_tokens=tokens)

def _blend_layers(fwd, lay, ids_c, ids_s, pos_s, s_block, s_slot, s_table, base, copy, c_block, c_slot,
                  ratio, blend, private, stats):
    dev, bs, n_layers, c = fwd.device, fwd.bs, fwd.cfg.num_layers, blend.check_layer
    n_chunk = lay.num_tokens
    h = fwd.model.embed(torch.cat([ids_c, ids_s]))
    pos = torch.cat([lay.pos, pos_s])
    tables: list[BlockTable] = []
    pre_table = base
    pre_block = pre_slot = pre_blocks = None
    if c > 1 and not copy:
        # layers 1..c-1 are computed in full: every chunk token gets a private slot there
        pre_blocks, pre_block, pre_slot, t = fwd._private(lay.pos)
        private += pre_blocks
        pre_table = BlockTable.cat([t, s_table])
    for layer in range(c):
        fwd._wait(layer)
        q, k, v = fwd.model.attention_inputs(layer, h, pos)
        if layer == 0:
            table = base  # layer-0 KV depends on the token alone: the cache holds it exactly
            fwd.pool.write(layer, s_block, s_slot, k[n_chunk:], v[n_chunk:])
        else:
            table = pre_table
            wb = torch.cat([c_block if copy else pre_block, s_block])
            ws = torch.cat([c_slot if copy else pre_slot, s_slot])
            fwd.pool.write(layer, wb, ws, k, v)
        tables.append(table)
        h = fwd.model.finish_layer(layer, h, fwd._attend(layer, q, pos, table))

    # check layer: rank chunk tokens by how far their fresh KV is from the cached KV
    fwd._wait(c)
    q, k, v = fwd.model.attention_inputs(c, h, pos)
    if copy:
        k_cached, v_cached = fwd.pool.read(c, c_block, c_slot)
    else:
        k_cached, v_cached = lay.cached_kv(fwd.pool, c, fwd.model.inv_freq)
    n_keep = int(round(ratio * n_chunk))
    sel = select_hkvd(k[:n_chunk], v[:n_chunk], k_cached, v_cached, n_keep, blend.deviation)
    stats.tokens_recomputed = int(sel.numel())
    keep = torch.cat([sel, torch.arange(n_chunk, n_chunk + pos_s.numel(), device=dev)])
    h, pos, q, k, v = h[keep], pos[keep], q[keep], k[keep], v[keep]
    if copy:
        post = base
        sel_block, sel_slot = c_block[sel], c_slot[sel]
    elif pre_block is not None:
        hidden = torch.zeros(n_chunk, dtype=torch.bool, device=dev)
        hidden.index_fill_(0, sel, True)  # a Python scalar: no host-to-device copy (and no sync)
        pre_only = BlockTable.for_run(pre_blocks, n_chunk, bs, 0, dev, ~hidden)
        post = BlockTable.cat(lay.shared_tables(bs, dev, hidden) + [pre_only, s_table])
        sel_block, sel_slot = pre_block[sel], pre_slot[sel]
    else:
        hidden = torch.zeros(n_chunk, dtype=torch.bool, device=dev)
        hidden.index_fill_(0, sel, True)  # a Python scalar: no host-to-device copy (and no sync)
        tabs = lay.shared_tables(bs, dev, hidden)
        if sel.numel():
            blocks, sel_block, sel_slot, sel_table = fwd._private(lay.pos[sel])
            private += blocks
            tabs.append(sel_table)
        else:
            sel_block = sel_slot = torch.zeros(0, dtype=torch.long, device=dev)
        post = BlockTable.cat(tabs + [s_table])
    wb, ws = torch.cat([sel_block, s_block]), torch.cat([sel_slot, s_slot])
    fwd.pool.write(c, wb, ws, k, v)
    h = fwd.model.finish_layer(c, h, fwd._attend(c, q, pos, post))
    h = fwd._tail(c + 1, h, pos, post, wb, ws)
    tables += [post] * (n_layers - c)
    return fwd.model.logits(h[-1:])[-1], tables
