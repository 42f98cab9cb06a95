"""Deferred-RoPE paged attention: the engine's one attention interface.

``paged_prefill_attention`` and ``paged_decode_attention`` dispatch to the plain-torch twin
(``reference.py``) or the Triton kernels (``triton.py``); see ``reference.py`` for the layout.

NOTE: block-table metadata must fit the kernels' packed encoding (block id, offset, slot mask in
64-bit words). ``check_encodable`` refuses what does not fit, with a clear error; nothing is clamped.
"""

from __future__ import annotations

import torch

from kernels.paged_attention import reference

# the packed word per entry (_meta.py): block id << ID_SHIFT | offset << OFFSET_SHIFT | 16 mask bits
OFFSET_SHIFT, OFFSET_BITS = 16, 24
ID_SHIFT = OFFSET_SHIFT + OFFSET_BITS   # 40
MAX_BLOCK_ID = (1 << (63 - ID_SHIFT)) - 1   # 23 bits: the word stays a non-negative int64 (8,388,607 blocks)
MAX_OFFSET = (1 << OFFSET_BITS) - 1         # a chunk's global start, 24 bits: every position a 128K model addresses
MAX_BLOCK_SIZE = 64            # slot mask bits per entry

__all__ = ["paged_prefill_attention", "paged_decode_attention", "check_encodable",
           "MAX_BLOCK_ID", "MAX_OFFSET", "MAX_BLOCK_SIZE", "ID_SHIFT", "OFFSET_SHIFT", "OFFSET_BITS"]


def check_encodable(block_size: int, block_ids: torch.Tensor, offsets: torch.Tensor) -> None:
    """Raise ValueError if a block table cannot be encoded in the kernels' metadata."""
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block size {block_size} is outside 1..{MAX_BLOCK_SIZE} (slot masks are 64-bit)")
    if block_ids.numel():
        hi = int(block_ids.max())
        if hi > MAX_BLOCK_ID or int(block_ids.min()) < 0:
            raise ValueError(f"block id {hi} does not fit the {63 - ID_SHIFT}-bit block field (0..{MAX_BLOCK_ID})")
    if offsets.numel():
        hi, lo = int(offsets.max()), int(offsets.min())
        if hi > MAX_OFFSET or lo < 0:
            bad = hi if hi > MAX_OFFSET else lo
            raise ValueError(f"position offset {bad} does not fit the {OFFSET_BITS}-bit offset field (0..{MAX_OFFSET})")


def _impl(backend: str):
    if backend == "torch":
        return reference
    if backend == "triton":
        from kernels.paged_attention import triton as impl

        return impl
    raise ValueError(f"unknown attention backend {backend!r} (torch or triton)")


def paged_prefill_attention(q, q_pos, k_cache, v_cache, slot_pos, block_ids, offsets, masks,
                            cu_q, cu_entries, inv_freq, scale, backend: str = "torch"):
    """Queries [Tq, Hq, D] at global positions attend causally to paged, lazily rotated keys.

    Returns (out [Tq, Hq, D], lse [Tq, Hq] fp32). See reference.py for every argument's layout.
    """
    return _impl(backend).paged_prefill_attention(q, q_pos, k_cache, v_cache, slot_pos, block_ids,
                                                  offsets, masks, cu_q, cu_entries, inv_freq, scale)


def paged_decode_attention(q, k_cache, v_cache, block_ids, offsets, masks, cu_entries, inv_freq,
                           scale, backend: str = "torch"):
    """One query per sequence [B, Hq, D] over its entries. Returns (out [B, Hq, D], lse [B, Hq])."""
    return _impl(backend).paged_decode_attention(q, k_cache, v_cache, block_ids, offsets, masks,
                                                 cu_entries, inv_freq, scale)
