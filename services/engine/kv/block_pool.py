"""Paged KV memory: one pool of fixed-size blocks shared by every layer.

A block id names the same slots in every layer's K and V tensors. ``slot_pos`` records the
position each slot's key was rotated at when it was written: chunk-local for shared chunk blocks,
global for private blocks. Blocks are handed out and returned whole; who owns a block (a cached
chunk or a request) is tracked by the chunk cache and the request, not here.

New K/V reach the pool two ways: ``at`` names the slots for the model's q|k|v kernel, which stores
the rows it makes (the layer passes), and ``write`` stores given rows (loads, hand-offs, blend copies).

Beside K and V, every block has its page bounds per layer (``kmin``/``kmax`` [N, Hkv, D], the pool's dtype): the
elementwise min and max of the keys of its written slots, as the pool holds them (chunk-local for a shared chunk's
blocks). Sparse decode (services/engine/decode/quest.py) scores pages by them. They are not kept current on every
write: ``bound`` computes them for given blocks and slots, and the decode policies that read them say when (a
chunk's once per residency, a sequence's private blocks when it starts decoding and as it appends).
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.fused import KVWrite, default_backend, write_kv
from kernels.sparse import bound_pages


def block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, itemsize: int) -> tuple[int, int]:
    """Bytes one block takes over every layer: (K and V of its slots, its page bounds). The bounds are two rows
    per layer, 1/block_size of the K and V (6.25% at 16 slots)."""
    row = 2 * num_layers * num_kv_heads * head_dim * itemsize
    return block_size * row, row


class PoolExhausted(RuntimeError):
    """No free block is left and nothing can be evicted."""


class BlockPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, device: torch.device, dtype: torch.dtype):
        if num_blocks <= 0:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # every layer's K (and V) in one tensor [L, N, BS, Hkv, D], self.k[layer] a view of it: a chunk written over
        # a run of blocks takes the run's views of all layers in a few calls, not a few a layer (``write_runs``)
        self.k_all = torch.zeros((num_layers, *shape), device=device, dtype=dtype)
        self.v_all = torch.zeros((num_layers, *shape), device=device, dtype=dtype)
        self.k, self.v = list(self.k_all.unbind(0)), list(self.v_all.unbind(0))
        self.kmin = [torch.zeros(shape[:1] + shape[2:], device=device, dtype=dtype) for _ in range(num_layers)]
        self.kmax = [torch.zeros(shape[:1] + shape[2:], device=device, dtype=dtype) for _ in range(num_layers)]
        self.slot_pos = torch.zeros((num_blocks, block_size), device=device, dtype=torch.int32)
        self.block_size = block_size
        self.num_blocks = num_blocks
        # block_bytes: a block's K and V (what a chunk's bytes count); bounds_bytes: its page bounds beside them
        self.block_bytes, self.bounds_bytes = block_bytes(num_layers, block_size, num_kv_heads, head_dim,
                                                          self.k[0].element_size())
        # free blocks as a mask: allocation hands out the lowest free ids, and finds runs of consecutive
        # ones (a chunk on a run is written by plain copies, see ``run``) with a few numpy ops
        self._is_free = np.ones(num_blocks, dtype=bool)
        self._n_free = num_blocks
        self.reserved: set[int] = set()
        self.kernels = default_backend(torch.device(device))  # write: one Triton kernel for K and V on CUDA

    @property
    def num_free(self) -> int:
        return self._n_free

    def reserve(self) -> int:
        """Take one block out of circulation for good (the static tails' scratch block)."""
        block = self.allocate(1)[0]
        self.reserved.add(block)
        return block

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - len(self.reserved)

    def allocate(self, n: int, contiguous: bool = False) -> list[int]:
        """n free blocks, the lowest ids first; ``contiguous``: consecutive ids where some run of n is
        free (else any n)."""
        if n <= 0:
            return []
        if n > self._n_free:
            raise PoolExhausted(f"KV pool exhausted: {n} blocks wanted, {self._n_free} free of {self.num_blocks}")
        ids = None
        if contiguous and n > 1:
            free = np.concatenate([[0], np.cumsum(self._is_free, dtype=np.int64)])
            starts = np.flatnonzero(free[n:] - free[:-n] == n)  # i where blocks i..i+n-1 are all free
            if starts.size:
                ids = np.arange(starts[0], starts[0] + n)
        if ids is None:
            # the lowest free id (argmax: ~0.5 us), then a window after it (a full scan costs ~12 us at 6k
            # blocks, on the first token's path): the window's free ids are the lowest ones when it has n
            first = int(self._is_free.argmax())
            ids = np.flatnonzero(self._is_free[first:first + 64 * n]) + first
            if ids.size < n:
                ids = np.flatnonzero(self._is_free)
            ids = ids[:n]
        self._is_free[ids] = False
        self._n_free -= n
        return ids.tolist()

    def free(self, ids: list[int]) -> None:
        if not len(ids):
            return
        idx = np.asarray(ids, dtype=np.int64)
        outside = (idx < 0) | (idx >= self.num_blocks)
        if outside.any():
            raise RuntimeError(f"block {int(idx[outside][0])} is not in the pool of {self.num_blocks}")
        if self._is_free[idx].any():
            raise RuntimeError(f"block {int(idx[self._is_free[idx]][0])} freed twice or never allocated")
        if np.unique(idx).size != idx.size:
            raise RuntimeError(f"blocks {ids} name one block twice")
        self._is_free[idx] = True
        self._n_free += idx.size

    def run(self, blocks: list[int]) -> slice | None:
        """The blocks as one slice of every layer's K/V when they are consecutive ids, else None: a
        chunk laid densely over a run is one contiguous [n, Hkv, D] range, written by a plain copy."""
        if blocks and blocks == list(range(blocks[0], blocks[0] + len(blocks))):
            return slice(blocks[0], blocks[0] + len(blocks))
        return None

    def write_run(self, layer: int, run: slice, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [n, Hkv, D] densely from the first slot of the blocks ``run`` (see ``run``): two
        copies (host-to-device straight into the pool when k, v are pinned host tensors)."""
        dst_k, dst_v = self._run_views(layer, run, k.shape[0])
        dst_k.copy_(k, non_blocking=True)
        dst_v.copy_(v, non_blocking=True)

    def write_runs(self, run: slice, items) -> None:
        """``write_run`` for many layers, [(layer, k, v), ...], issued as one batched copy. Every layer in order (a
        whole chunk) takes the run's views of all layers in a few calls: each call is a round trip through the
        interpreter lock, which a decode worker's engine thread shares with its event loop."""
        items = [(layer, k, v) for layer, k, v in items]
        if not items:
            return
        n = items[0][1].shape[0]
        if [layer for layer, _, _ in items] == list(range(len(self.k))) and all(k.shape[0] == n for _, k, _ in items):
            dst = [*self._all_run_views(self.k_all, run, n), *self._all_run_views(self.v_all, run, n)]
            src = [k for _, k, _ in items] + [v for _, _, v in items]
        else:
            dst, src = [], []
            for layer, k, v in items:
                dst += self._run_views(layer, run, k.shape[0])
                src += [k, v]
        torch._foreach_copy_(dst, src, non_blocking=True)

    @staticmethod
    def _all_run_views(t: torch.Tensor, run: slice, n: int) -> tuple[torch.Tensor, ...]:
        """Every layer's first n slots of the blocks ``run`` of t [L, N, BS, Hkv, D]: L views [n, Hkv, D]."""
        return t[:, run].flatten(1, 2)[:, :n].unbind(0)

    def _run_views(self, layer: int, run: slice, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V slots of the blocks ``run``, the first n of them: [n, Hkv, D] views."""
        k, v = self.k[layer], self.v[layer]
        return k[run].view(-1, *k.shape[2:])[:n], v[run].view(-1, *v.shape[2:])[:n]

    def slots_for(self, blocks: list[int], n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block id and slot index of tokens 0..n-1 laid out densely over ``blocks``: ([n], [n])."""
        idx = torch.arange(n_tokens, device=self.slot_pos.device)
        table = torch.tensor(blocks, dtype=torch.long, device=self.slot_pos.device)
        return table[idx // self.block_size], idx % self.block_size

    def at(self, layer: int, block: torch.Tensor, slot: torch.Tensor) -> KVWrite:
        """Slots (block[n], slot[n]) int64 of one layer, as the fused kernels' write destination."""
        return KVWrite(self.k[layer], self.v[layer], block, slot)

    def write(self, layer: int, block: torch.Tensor, slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [n, Hkv, D] at (block[n], slot[n]) int64 of one layer, in the pool's dtype."""
        write_kv(k, v, self.at(layer, block, slot), backend=self.kernels)

    def write_layers(self, layers: slice, block: torch.Tensor, slot: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> None:
        """``write`` for a run of layers with one set of slots: k, v [len(layers), n, Hkv, D] at (block[n],
        slot[n]) of each, two indexed stores in all (a hand-off's private K/V: not two launches a layer)."""
        self.k_all[layers][:, block, slot] = k.to(self.k_all.dtype)
        self.v_all[layers][:, block, slot] = v.to(self.v_all.dtype)

    def read(self, layer: int, block: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer][block, slot], self.v[layer][block, slot]

    def bound(self, layer: int, blocks: torch.Tensor, visible: torch.Tensor) -> None:
        """Set layer ``layer``'s page bounds of ``blocks`` (int [n]) to the min and max of their keys in the slots
        ``visible`` shows (bool [n, BS]). A block named more than once gets the bounds of the union of its rows'
        slots; a block with no visible slot gets +inf / -inf (it scores -inf)."""
        # one kernel on CUDA (the torch twin is ~8 small kernels): QuestStep calls this at every sparse layer
        bound_pages(self.k[layer], self.kmin[layer], self.kmax[layer], blocks, visible, backend=self.kernels)

    def bound_dense(self, blocks: torch.Tensor, fill: torch.Tensor, layers=None) -> None:
        """``bound`` for blocks whose first fill[i] slots are written (int [n]), at every layer (or ``layers``)."""
        visible = torch.arange(self.block_size, device=fill.device)[None, :] < fill[:, None]
        for layer in range(len(self.k)) if layers is None else layers:
            self.bound(layer, blocks, visible)
