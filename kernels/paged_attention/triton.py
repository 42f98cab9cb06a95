"""Deferred-RoPE paged attention, Triton (twin: reference.py; same arguments, same results).

The public functions check shapes, pack the block table (kernels/paged_attention/_meta.py) and
launch the prefill (_prefill.py) or decode (_decode.py) kernel. Defaults below are the variants
bench/kernels/kernels.py measured fastest on an H100 (see bench/kernels/README.md).
"""

from __future__ import annotations

import dataclasses

import torch

from kernels.paged_attention import _decode, _prefill
from kernels.paged_attention._meta import (PackedTable, empty_decode_packed, empty_packed, pack, pack_into,
                                           pack_table_into)

__all__ = ["paged_prefill_attention", "paged_decode_attention", "paged_prefill_packed", "paged_decode_packed",
           "decode_splits", "prefill_key_bounds", "prefill_bounds_for", "pack", "pack_into", "pack_table_into", "empty_packed", "empty_decode_packed",
           "PackedTable", "prefill_config", "SHORT_PREFILL", "SHORT_PREFILL_TOKENS"]

# cos/sin of the per-entry offsets are gathered from an fp32 table packed with the block table (``pack``'s
# with_table), not evaluated in the kernel: 0.5-1% faster in both kernels (bench/kernels/README.md).

# paged_prefill_packed's configuration for calls of at most SHORT_PREFILL_TOKENS query tokens (a short suffix
# over many chunks: few query tiles, the grid made of KV splits; bench/short_attention/short_attention.py times the candidates);
# None: the default PrefillConfig for every call. Measured (bench/short_attention/README.md): a 64-token
# suffix over 6 x 512 keys takes 29.4 us cold with exact tiles and 8 splits (what min_split_steps=6 picks there)
# against 31.4 us with the default (6 splits and a fifth, empty query tile). (no cut_future: a suffix after its chunks has no key to cut, and the pass keeps its one key-bounds launch)
SHORT_PREFILL = _prefill.PrefillConfig(exact_tiles=True, min_split_steps=6)
SHORT_PREFILL_TOKENS = 128
# longer calls skip each offset group's keys after the tile's latest query (PrefillConfig.cut_future; measured
# on an H100, bench/engine/README.md: tessera@0.15 22.5 / 21.9 against 24.2 / 22.8 ms, tessera@0.3 36.4 / 35.9
# against 38.2 / 38.1, the same bits) and query tiles that are all padding (skip_empty_tiles); their KV splits
# are picked from the grid unless the caller names a count
LONG_PREFILL = _prefill.PrefillConfig(cut_future=True, skip_empty_tiles=True)


def _check(q, k_cache, v_cache, inv_freq, cu_entries) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be [N, BS, Hkv, D]")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache must share strides with a contiguous head dimension")
    if q.dim() != 3 or q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} must be [T, Hq, D] with D = {k_cache.shape[3]}")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} KV heads")
    dim = q.shape[2]
    if dim < 32 or dim & (dim - 1):
        raise ValueError(f"the Triton kernels need a power-of-two head_dim >= 32, got {dim}")
    if q.dtype != k_cache.dtype or q.dtype != v_cache.dtype:
        raise ValueError(f"q, k_cache and v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if inv_freq.numel() != dim // 2:
        raise ValueError(f"inv_freq has {inv_freq.numel()} entries, head_dim {dim} needs {dim // 2}")
    if cu_entries.dim() != 1 or cu_entries.numel() < 1:
        raise ValueError("cu_entries must be 1-D [B+1]")


def _prep(q, inv_freq, *idx):
    q = q if q.stride(2) == 1 else q.contiguous()
    inv_freq = inv_freq.to(device=q.device, dtype=torch.float32).contiguous()
    return (q, inv_freq, *(t.to(torch.int32).contiguous() for t in idx))


def paged_prefill_attention(q, q_pos, k_cache, v_cache, slot_pos, block_ids, offsets, masks,
                            cu_q, cu_entries, inv_freq, scale):
    """New tokens attend to their sequence's entries, causal by global position.

    q [Tq, Hq, D] rotated at global q_pos [Tq]; cu_q, cu_entries int32 [B+1].
    Returns out [Tq, Hq, D] (q.dtype) and lse [Tq, Hq] fp32.
    """
    _check(q, k_cache, v_cache, inv_freq, cu_entries)
    if cu_q.shape != cu_entries.shape or q_pos.shape != q.shape[:1]:
        raise ValueError(f"cu_q {tuple(cu_q.shape)} / cu_entries {tuple(cu_entries.shape)} / q_pos {tuple(q_pos.shape)} disagree")
    if slot_pos.shape != k_cache.shape[:2]:
        raise ValueError(f"slot_pos {tuple(slot_pos.shape)} must be [N, BS] = {tuple(k_cache.shape[:2])}")
    q, inv_freq, q_pos, slot_pos, cu_q, cu_entries = _prep(q, inv_freq, q_pos, slot_pos, cu_q, cu_entries)
    packed = pack(block_ids, offsets, masks, k_cache.shape[1], inv_freq, with_table=True,
                  cu_entries=cu_entries)
    return _prefill.launch(q, q_pos, k_cache, v_cache, slot_pos, packed, cu_q, inv_freq, scale)


def prefill_key_bounds(packed: PackedTable, slot_pos: torch.Tensor, floors: bool = False):
    """The per-step key bounds the prefill kernel reads (one small launch): a caller running many
    layers over one packed table computes them once and passes them to every paged_prefill_packed
    (the table and the slot positions must not change in between). ``floors``: (the bounds, the key
    floors that a configuration with cut_future reads), a few more launches."""
    bs = slot_pos.shape[1]
    return _prefill.step_key_bounds(packed, slot_pos, bs, max(1, _prefill.PrefillConfig().min_block_n // bs),
                                    floors=floors)


def prefill_bounds_for(packed: PackedTable, slot_pos: torch.Tensor, n_tokens: int):
    """(key_hi, key_floor) for calls of n_tokens queries over this table: the floors only when the configuration
    those calls get (prefill_config) cuts future keys, else None. What a caller keeping them across layers
    passes to every paged_prefill_packed."""
    if prefill_config(n_tokens).cut_future:
        return prefill_key_bounds(packed, slot_pos, floors=True)
    return prefill_key_bounds(packed, slot_pos), None


def paged_prefill_packed(q, q_pos, k_cache, v_cache, slot_pos, packed: PackedTable, cu_q, inv_freq, scale,
                         num_splits: int | None = None, key_hi: torch.Tensor | None = None,
                         key_floor: torch.Tensor | None = None):
    """paged_prefill_attention on a table already packed with its offset groups (pack(..., cu_entries=)
    or pack_into). No device sync, no allocation but the outputs, the grid a function of the shapes
    alone: a CUDA graph can capture it. q_pos, slot_pos, cu_q int32; inv_freq fp32 on q's device.
    A query row at position -1 sees no key (out 0): how static callers make padding inert.
    ``key_hi`` (and ``key_floor``): prefill_key_bounds(packed, slot_pos[, floors=True]), when the caller keeps
    them across layers (a configuration with cut_future computes missing floors, and bounds with them)."""
    _check(q, k_cache, v_cache, inv_freq, cu_q)
    if packed.cu_groups is None or cu_q.shape != packed.cu_groups.shape or q_pos.shape != q.shape[:1]:
        raise ValueError(f"cu_q {tuple(cu_q.shape)} / q_pos {tuple(q_pos.shape)} disagree with the queries or "
                         "the packed table (pack it with cu_entries)")
    if slot_pos.shape != k_cache.shape[:2]:
        raise ValueError(f"slot_pos {tuple(slot_pos.shape)} must be [N, BS] = {tuple(k_cache.shape[:2])}")
    for name, t, dt in (("q_pos", q_pos, torch.int32), ("slot_pos", slot_pos, torch.int32),
                        ("cu_q", cu_q, torch.int32), ("inv_freq", inv_freq, torch.float32)):
        if t.dtype != dt or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous {dt}, got {t.dtype}")
    q = q if q.stride(2) == 1 else q.contiguous()
    cfg = prefill_config(q.shape[0], num_splits)
    if key_hi is not None and cfg.min_block_n != _prefill.PrefillConfig().min_block_n:
        key_hi = None  # prefill_key_bounds computed them for the default's step: recompute for this one
    return _prefill.launch(q, q_pos, k_cache, v_cache, slot_pos, packed, cu_q, inv_freq, scale, cfg=cfg,
                           key_hi=key_hi, key_floor=key_floor)


def prefill_config(n_tokens: int, num_splits: int | None = None) -> _prefill.PrefillConfig:
    """The configuration paged_prefill_packed launches n_tokens queries with (SHORT_PREFILL for short calls, else
    LONG_PREFILL); num_splits None: the configuration's own (None: the kernel picks its splits from the shapes)."""
    base = SHORT_PREFILL if n_tokens <= SHORT_PREFILL_TOKENS else LONG_PREFILL
    return base if num_splits is None else dataclasses.replace(base, num_splits=num_splits)


def paged_decode_attention(q, k_cache, v_cache, block_ids, offsets, masks, cu_entries, inv_freq, scale):
    """One query per sequence [B, Hq, D] over all its visible entries. Returns out [B, Hq, D], lse [B, Hq]."""
    _check(q, k_cache, v_cache, inv_freq, cu_entries)
    if cu_entries.numel() != q.shape[0] + 1:
        raise ValueError(f"cu_entries has {cu_entries.numel()} bounds for {q.shape[0]} sequences")
    q, inv_freq, cu_entries = _prep(q, inv_freq, cu_entries)
    packed = pack(block_ids, offsets, masks, k_cache.shape[1], inv_freq, with_table=True)
    return _decode.launch(q, k_cache, v_cache, packed, cu_entries, inv_freq, scale)


def decode_splits(n_seqs: int, n_kv_heads: int, n_entries: int, device) -> int:
    """The split count paged_decode_attention would pick for n_seqs sequences over n_entries entries
    in all: what a caller with a fixed grid (a CUDA graph) fixes once per shape bucket."""
    return _decode.pick_splits(_decode.DecodeConfig(), n_seqs, n_kv_heads, n_entries, device)


def paged_decode_packed(q, k_cache, v_cache, packed: PackedTable, cu_entries, inv_freq, scale, num_splits: int):
    """paged_decode_attention on a table already packed (pack or pack_table_into) with a fixed split
    count. No device sync, no allocation but the outputs, the grid a function of the shapes and
    num_splits alone: a CUDA graph can capture it. cu_entries int32 [B+1] may be any contiguous row
    of a larger buffer and its bounds need not start at 0: entries outside every sequence's bounds
    are never read. A sequence with no entries gets out 0 (how static callers make padding inert).
    inv_freq fp32 on q's device. Returns out [B, Hq, D] (q.dtype), lse [B, Hq] fp32."""
    _check(q, k_cache, v_cache, inv_freq, cu_entries)
    if cu_entries.numel() != q.shape[0] + 1:
        raise ValueError(f"cu_entries has {cu_entries.numel()} bounds for {q.shape[0]} sequences")
    for name, t, dt in (("cu_entries", cu_entries, torch.int32), ("inv_freq", inv_freq, torch.float32)):
        if t.dtype != dt or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous {dt}, got {t.dtype}")
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    q = q if q.stride(2) == 1 else q.contiguous()
    return _decode.launch(q, k_cache, v_cache, packed, cu_entries, inv_freq, scale,
                          cfg=_decode.DecodeConfig(num_splits=num_splits))
