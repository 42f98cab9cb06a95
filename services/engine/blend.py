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

from dataclasses import dataclass

import torch

from kernels.rope import rope_cos_sin, rotate
from services.engine.block_table import BlockTable
from services.engine.request import PlacedChunk

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
            blocks = torch.tensor(p.entry.blocks, dtype=torch.long, device=device)
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
