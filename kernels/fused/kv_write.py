"""Where a layer's new K/V rows go: one layer of the paged pool and each token's (block, slot).

Shared by ``qkv_heads`` (which stores the rotated k and v straight into the cache) and ``write_kv``
(k, v given), in both the Triton kernels and their twins.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVWrite:
    """Token t's k and v rows [Hkv, D] go to k_cache[block[t], slot[t]] and v_cache[block[t], slot[t]],
    cast to the cache's dtype.

    k_cache, v_cache: [N, BS, Hkv, D], contiguous (one layer of ``BlockPool``), any float dtype.
    block, slot: int64 [T] on the cache's device. NOTE: their range is the caller's invariant and is
    not checked here (that would sync with the GPU); tokens sharing a (block, slot) leave one of them."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block: torch.Tensor
    slot: torch.Tensor

    def check(self, t: int, num_kv_heads: int, head_dim: int) -> None:
        """Refuse, by name, a destination that cannot take T rows of [num_kv_heads, head_dim]."""
        kc, vc = self.k_cache, self.v_cache
        if kc.dim() != 4 or tuple(kc.shape[2:]) != (num_kv_heads, head_dim) or vc.shape != kc.shape:
            raise ValueError(f"KV caches {tuple(kc.shape)}/{tuple(vc.shape)} are not [N, BS, {num_kv_heads}, "
                             f"{head_dim}] alike")
        if not (kc.is_contiguous() and vc.is_contiguous()):
            raise ValueError("KV caches must be contiguous (rows are addressed as block * BS + slot)")
        for name, idx in (("block", self.block), ("slot", self.slot)):
            if idx.shape != (t,) or idx.dtype != torch.int64 or idx.device != kc.device:
                raise ValueError(f"{name} {tuple(idx.shape)} {idx.dtype} on {idx.device} must be int64 [{t}] "
                                 f"on {kc.device}")
