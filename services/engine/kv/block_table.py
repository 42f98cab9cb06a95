"""A request's view of paged KV: block-table entries (physical block, position offset, slot mask).

Attention over a request is attention over the union of its entries (softmax ignores order):
  - a shared chunk entry: offset = the chunk's global start (keys were rotated at local positions;
    the kernel rotates them by the offset), mask hides padding and tokens recomputed privately;
  - a private entry: offset 0, keys already rotated at their global positions.
Nothing is copied or re-rotated in memory to place a chunk.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch


def host_to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list (numpy array, CPU tensor) as a device tensor without a stream sync: staged in
    pinned memory (the caching host allocator keeps it until the copy is done) and copied asynchronously.
    ``torch.tensor(values, device=cuda)`` copies from pageable memory, which waits for the GPU first."""
    if isinstance(values, (np.ndarray, torch.Tensor)):
        t = torch.as_tensor(values, dtype=dtype)
    else:
        t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


_TORCH_INT = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


def host_to_device_many(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Host int64/int32 arrays as device tensors of the same dtypes and shapes, from ONE pinned
    asynchronous copy of their bytes (int64 ones first, so each view is aligned): what a pass knows on
    the host goes over without a cast or an arange on the device."""
    for a in arrays:
        if a.dtype not in _TORCH_INT:
            raise ValueError(f"host_to_device_many takes int64/int32 arrays, got {a.dtype}")
    wide = [a.dtype.itemsize == 8 for a in arrays]
    n64 = sum(a.size for a, w in zip(arrays, wide) if w)
    n32 = sum(a.size for a, w in zip(arrays, wide) if not w)
    staged = torch.empty(8 * n64 + 4 * n32 + 8, dtype=torch.uint8, pin_memory=device.type == "cuda")
    raw = staged.numpy()
    lanes = (raw[:8 * n64].view(np.int64), raw[8 * n64:8 * n64 + 4 * n32].view(np.int32))
    at = [0, 0]
    for a, w in zip(arrays, wide):
        lane = 0 if w else 1
        lanes[lane][at[lane]:at[lane] + a.size] = a.reshape(-1)
        at[lane] += a.size
    dev = staged.to(device, non_blocking=True)
    # one split per lane: its views are made in one call, not one Python slice each
    lane_parts = (iter(dev[:8 * n64].view(torch.int64).split([a.size for a, w in zip(arrays, wide) if w])),
                  iter(dev[8 * n64:8 * n64 + 4 * n32].view(torch.int32).split([a.size for a, w in zip(arrays, wide)
                                                                             if not w])))
    out = []
    for a, w in zip(arrays, wide):
        t = next(lane_parts[0 if w else 1])
        out.append(t if a.ndim == 1 else t.view(a.shape))
    return out


def full_mask(n: int) -> int:
    """Slot mask with the first n slots visible, as a signed int64 value."""
    m = (1 << n) - 1
    return m - (1 << 64) if m >= (1 << 63) else m


def dense_run(blocks: list[int], n: int, block_size: int) -> tuple[np.ndarray, ...]:
    """n tokens laid densely over ``blocks`` (offset 0), on the host as int64 arrays: the entries' ids,
    offsets and masks [len(blocks)], and each token's block and slot [n]."""
    ids = np.asarray(blocks, dtype=np.int64)
    masks = np.full(len(blocks), full_mask(block_size), dtype=np.int64)
    if len(blocks) and n % block_size:
        masks[-1] = full_mask(n % block_size)
    slots = np.arange(n, dtype=np.int64) % block_size
    return ids, np.zeros(len(blocks), dtype=np.int64), masks, np.repeat(ids, block_size)[:n], slots


def chunk_rows(placed, block_size: int) -> tuple[np.ndarray, list[int], list[int]]:
    """The shared entries of chunks placed in a request (``PlacedChunk``: an entry's blocks, length and base, a
    start), in order, as int64 rows [3, entries]: block id, offset (the chunk's rot = start - base), mask (the
    chunk's token slots; its last entry's padding hidden); and each chunk's rot and first entry (in these rows)."""
    c_ids = np.fromiter(itertools.chain.from_iterable(p.entry.blocks for p in placed), dtype=np.int64)
    rows = np.empty((3, len(c_ids)), dtype=np.int64)
    rots, firsts, n_blocks, last, last_mask, at = [], [], [], [], [], 0
    for p in placed:  # a handful of chunks: plain ints beat numpy calls
        nb = len(p.entry.blocks)
        rots.append(p.start - p.entry.base)
        firsts.append(at)
        n_blocks.append(nb)
        at += nb
        last.append(at - 1)
        last_mask.append(full_mask(p.entry.length - (nb - 1) * block_size))
    rows[0] = c_ids
    rows[1] = np.repeat(np.asarray(rots, dtype=np.int64), n_blocks)
    rows[2] = full_mask(block_size)
    rows[2, last] = last_mask
    return rows, rots, firsts


@dataclass(frozen=True, slots=True)
class BlockTable:
    """Entries of one sequence for one layer.

    block_ids int32 [E], offsets int32 [E] (RoPE offset applied in attention), masks int64 [E]
    (bit t = slot t visible). Host-side facts that spare the backends a sync: ``max_offset`` (offsets.max()),
    ``visible`` (the number of visible slots, None when only the device knows it). ``id_rows`` int64 [2, E]:
    the block ids and offsets the int32 ones were cast from, when the table was built from rows (static
    tails copy them as they are). ``host_rows`` int64 numpy [3, E]: the same ids, offsets and masks on the
    host, when the table was built there (a decode step's layout then reads them without a device copy).
    """

    block_ids: torch.Tensor
    offsets: torch.Tensor
    masks: torch.Tensor
    max_offset: int = 0
    visible: int | None = None
    id_rows: torch.Tensor | None = None
    host_rows: np.ndarray | None = None

    @staticmethod
    def from_host(block_ids: list[int], offsets: list[int], masks: list[int], device: torch.device,
                  visible: int | None = None) -> "BlockTable":
        """A table from host lists [E] with one host-to-device copy and one cast."""
        rows = host_to_device([block_ids, offsets, masks], torch.int64, device)
        return BlockTable.from_rows(rows, max(offsets, default=0), visible)

    @staticmethod
    def from_rows(rows: torch.Tensor, max_offset: int, visible: int | None = None) -> "BlockTable":
        """A table over int64 rows [3, E] (block ids, offsets, masks) on the device: the masks are a view."""
        ids_offs = rows[:2].to(torch.int32)
        return BlockTable(ids_offs[0], ids_offs[1], rows[2], max_offset, visible, rows[:2])

    @property
    def num_entries(self) -> int:
        return int(self.block_ids.numel())

    @staticmethod
    def empty(device: torch.device) -> "BlockTable":
        z = torch.zeros(0, dtype=torch.int32, device=device)
        return BlockTable(z, z.clone(), torch.zeros(0, dtype=torch.int64, device=device), 0, 0)

    @staticmethod
    def for_run(blocks: list[int], n_tokens: int, block_size: int, offset: int, device: torch.device,
                hidden: torch.Tensor | None = None) -> "BlockTable":
        """Entries of ``n_tokens`` laid densely over ``blocks``, all with one offset.

        ``hidden`` (bool [n_tokens]) hides tokens, e.g. a chunk's tokens recomputed for this request.
        """
        masks = []
        for j in range(len(blocks)):
            n = min(block_size, n_tokens - j * block_size)
            masks.append(full_mask(n))
        mask_t = host_to_device(masks, torch.int64, device)
        if hidden is not None and hidden.numel():
            # clear bit (t % bs) of entry (t // bs) for every hidden token t, with device ops only (no
            # any()/nonzero sync): the bits of one entry are distinct, so their sum is their OR
            pad = torch.zeros(len(blocks) * block_size, dtype=torch.int64, device=device)
            pad[:n_tokens] = hidden.to(torch.int64)
            bits = pad.view(len(blocks), block_size) << torch.arange(block_size, device=device, dtype=torch.int64)
            mask_t = mask_t & ~bits.sum(dim=1)
        return BlockTable(
            host_to_device(blocks, torch.int32, device),
            torch.full((len(blocks),), offset, dtype=torch.int32, device=device),
            mask_t,
            offset,
            n_tokens if hidden is None else None,
        )

    @staticmethod
    def cat(tables: list["BlockTable"]) -> "BlockTable":
        tables = [t for t in tables if t.num_entries]
        if not tables:
            raise ValueError("a block table needs at least one entry")
        return BlockTable(
            torch.cat([t.block_ids for t in tables]),
            torch.cat([t.offsets for t in tables]),
            torch.cat([t.masks for t in tables]),
            max(t.max_offset for t in tables),
            None if any(t.visible is None for t in tables) else sum(t.visible for t in tables),
            None if any(t.id_rows is None for t in tables) else torch.cat([t.id_rows for t in tables], dim=1),
            None if any(t.host_rows is None for t in tables) else np.concatenate([t.host_rows for t in tables], axis=1),
        )
