"""Paged KV memory: one pool of fixed-size blocks shared by every layer.

A block id names the same slots in every layer's K and V tensors. ``slot_pos`` records the
position each slot's key was rotated at when it was written: chunk-local for shared chunk blocks,
global for private blocks. Blocks are handed out and returned whole; who owns a block (a cached
chunk or a request) is tracked by the chunk cache and the request, not here.

New K/V reach the pool two ways: ``at`` names the slots for the model's q|k|v kernel, which stores
the rows it makes (the layer passes), and ``write`` stores given rows (loads, hand-offs, blend copies).
"""

from __future__ import annotations

import torch

from kernels.fused import KVWrite, default_backend, write_kv


class PoolExhausted(RuntimeError):
    """No free block is left and nothing can be evicted."""


class BlockPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, device: torch.device, dtype: torch.dtype):
        if num_blocks <= 0:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.slot_pos = torch.zeros((num_blocks, block_size), device=device, dtype=torch.int32)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.block_bytes = 2 * num_layers * block_size * num_kv_heads * head_dim * self.k[0].element_size()
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._used: set[int] = set()
        self.reserved: set[int] = set()
        self.kernels = default_backend(torch.device(device))  # write: one Triton kernel for K and V on CUDA

    @property
    def num_free(self) -> int:
        return len(self._free)

    def reserve(self) -> int:
        """Take one block out of circulation for good (the static tails' scratch block)."""
        block = self.allocate(1)[0]
        self.reserved.add(block)
        return block

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - len(self.reserved)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(f"KV pool exhausted: {n} blocks wanted, {len(self._free)} free of {self.num_blocks}")
        ids = [self._free.pop() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if i not in self._used:
                raise RuntimeError(f"block {i} freed twice or never allocated")
            self._used.remove(i)
            self._free.append(i)

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

    def read(self, layer: int, block: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer][block, slot], self.v[layer][block, slot]
