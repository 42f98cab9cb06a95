"""Block-table metadata for the Triton kernels: validation, 64-bit packing, per-entry cos/sin.

Packed word per entry (int64), in LazyAttention's layout with a wider offset:
    word = block_id << 40 | offset << 16 | (mask & 0xFFFF)      (ID_SHIFT, OFFSET_SHIFT, OFFSET_BITS = 24)
so a chunk may start at any position up to 2**24 - 1 (a 16-bit offset, LazyAttention's, stopped at 65,535: short of
the 131,072 positions Llama-3.1-class models address) and a pool may hold up to 2**23 blocks. The low 16 bits hold the whole slot mask when the block size is at most 16. For block sizes 17..64
the kernels read the full int64 mask from its own word (``masks``) and ignore the low 16 bits.
NOTE: a block id or offset that does not fit is refused (``check_encodable``), never clamped: an
overflowing offset would silently corrupt the block id above it.

The optional table holds one fp32 row per entry, [cos(offset * inv_freq) | sin(offset * inv_freq)]
([E, D]), so that kernels gather cos/sin instead of evaluating them.

Offset groups (prefill): maximal runs of consecutive entries of one sequence that share an offset
(one placed chunk, or the private blocks). group_starts[g] is the first entry of group g, padded
with E (so group g ends at group_starts[g + 1]); sequence b owns groups cu_groups[b]..cu_groups[b+1].
Built with a few device ops and no host sync.

A packed table is cached against its input tensors (identity and version counter): the engine
passes the same block table to every layer, so validation (one sync) and packing run once a step.
A caller that knows its table's bounds on the host (the engine: block ids below its pool size, the
table's largest offset) passes ``bounds`` and skips the sync. ``pack_into`` writes into a table made by
``empty_packed``, whose tensors keep their addresses: what a captured CUDA graph reads. Decode tables
have no offset groups: ``empty_decode_packed`` / ``pack_table_into`` are their fixed-address pair, and
take block ids, offsets and masks in any integer dtype (the decode graphs keep all three int64).
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.paged_attention import ID_SHIFT, MAX_BLOCK_ID, MAX_OFFSET, OFFSET_BITS, OFFSET_SHIFT, check_encodable

# the word's fields, as the kernels read them
ID_SHIFT_C = tl.constexpr(ID_SHIFT)
OFFSET_SHIFT_C = tl.constexpr(OFFSET_SHIFT)
OFFSET_MASK_C = tl.constexpr((1 << OFFSET_BITS) - 1)

# entries per program of the pack kernel: 32 keep the [BLOCK, D/2] cos/sin tiles in registers (256 spill
# 2.4 KB of stack on sm_90, tests/kernels/compile_sm90.py) and spread a table's cos/sin over many SMs
# (a 200-entry prefill table on one program of 256 took 106 us on an H100, bench/engine/README.md)
PACK_BLOCK = 32


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 on the CPU interpreter, to exercise splits)."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def dot_f32(dtype: torch.dtype) -> bool:
    """Whether to feed tl.dot fp32: Triton's CPU interpreter (3.9) multiplies bf16 operands wrongly."""
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True, slots=True)
class PackedTable:
    """Kernel-ready block table. meta int64 [E]; masks int64 [E] (read when block_size > 16);
    table fp32 [E, D] of per-entry cos|sin, or None when the kernel computes them; offset groups
    (prefill only, see the module docstring)."""

    meta: torch.Tensor
    masks: torch.Tensor
    table: torch.Tensor | None
    group_starts: torch.Tensor | None = None  # int32 [E + 2]
    cu_groups: torch.Tensor | None = None  # int32 [B + 1]

    @property
    def mask_in_word(self) -> bool:
        return self.masks is self.meta


@triton.jit
def _pack_kernel(ids_ptr, off_ptr, mask_ptr, invf_ptr, meta_ptr, tab_ptr, n,
                 D2: tl.constexpr, BLOCK: tl.constexpr, WRITE_TABLE: tl.constexpr):
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = e < n
    ids = tl.load(ids_ptr + e, mask=ok, other=0).to(tl.int64)
    off = tl.load(off_ptr + e, mask=ok, other=0).to(tl.int64)
    m = tl.load(mask_ptr + e, mask=ok, other=0).to(tl.int64)
    word = (ids << ID_SHIFT_C) | (off << OFFSET_SHIFT_C) | (m & 0xFFFF)
    tl.store(meta_ptr + e, word, mask=ok)
    if WRITE_TABLE:
        d = tl.arange(0, D2)
        ang = off.to(tl.float32)[:, None] * tl.load(invf_ptr + d)[None, :]  # [BLOCK, D2]
        row = tab_ptr + e[:, None] * (2 * D2) + d[None, :]
        tl.store(row, tl.cos(ang), mask=ok[:, None])
        tl.store(row + D2, tl.sin(ang), mask=ok[:, None])


def validate(block_size: int, block_ids: torch.Tensor, offsets: torch.Tensor,
             bounds: tuple[int, int] | None = None) -> None:
    """check_encodable with one device sync instead of four: the detailed check runs only on failure.
    ``bounds`` = (largest block id, largest offset) known on the host: checked there, no sync."""
    if bounds is not None and 1 <= block_size <= 64 and bounds[0] <= MAX_BLOCK_ID and bounds[1] <= MAX_OFFSET:
        return  # upper bounds that fit (block ids and offsets are never negative where bounds are known)
    if not 1 <= block_size <= 64 or block_ids.numel() == 0:
        check_encodable(block_size, block_ids, offsets)
        return
    lo_id, hi_id = torch.aminmax(block_ids)
    lo_off, hi_off = torch.aminmax(offsets)
    lo_id, hi_id, lo_off, hi_off = torch.stack([lo_id.long(), hi_id.long(), lo_off.long(), hi_off.long()]).tolist()
    if lo_id < 0 or hi_id > MAX_BLOCK_ID or lo_off < 0 or hi_off > MAX_OFFSET:
        check_encodable(block_size, block_ids, offsets)
        raise AssertionError("unreachable: check_encodable accepted an out-of-range block table")


def offset_groups(offsets: torch.Tensor, cu_entries: torch.Tensor,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs of equal offset inside each sequence: (group_starts int32 [E + 2], cu_groups int32 [B + 1]),
    written into ``out`` when given."""
    n = offsets.numel()
    dev = offsets.device
    cu = cu_entries.long()
    first = torch.zeros(n + 1, dtype=torch.bool, device=dev)
    # NOTE: fill_/index_fill_ with Python scalars, not ``x[i] = scalar``: that copies a host scalar to
    # the device, which waits for the GPU (three host syncs per packed table, bench/engine/README.md)
    first.index_fill_(0, cu[:-1], True)  # an empty sequence marks the next one's first entry (or the pad slot)
    first = first[:n]
    if n:
        first[1:] |= offsets[1:] != offsets[:-1]
        first[:1].fill_(True)
    count = torch.cumsum(first.to(torch.int32), 0)  # groups started up to and including entry i
    before = torch.cat([torch.zeros(1, dtype=torch.int32, device=dev), count])  # [E + 1]
    if out is None:
        starts = torch.full((n + 2,), n, dtype=torch.int32, device=dev)
        cu_groups = torch.empty(cu.numel(), dtype=torch.int32, device=dev)
    else:
        starts, cu_groups = out
        starts.fill_(n)
    slot = torch.where(first, count.long() - 1, n + 1)  # non-first entries write the spare slot
    starts.scatter_(0, slot, torch.arange(n, dtype=torch.int32, device=dev))
    starts[n + 1:].fill_(n)
    cu_groups.copy_(before[cu])
    return starts, cu_groups


_CACHE: "OrderedDict[int, tuple]" = OrderedDict()  # id(block_ids) -> (signature, weakrefs, packed)
_CACHE_SIZE = 32


def _signature(tensors, extra) -> tuple | None:
    """Identity and in-place version of each input; None for inference tensors, whose in-place
    writes are not versioned (a cached pack could go stale), so they are packed every call."""
    if any(t.is_inference() for t in tensors):
        return None
    return tuple((id(t), t._version) for t in tensors) + extra


def pack(block_ids, offsets, masks, block_size: int, inv_freq: torch.Tensor, with_table: bool,
         cu_entries: torch.Tensor | None = None, bounds: tuple[int, int] | None = None) -> PackedTable:
    """Validate and pack a block table (one launch), cached per input tensors. with_table also
    writes the per-entry cos|sin rows; cu_entries (prefill) also builds the offset groups;
    bounds (see validate) replaces the validation sync by a host check."""
    inputs = (block_ids, offsets, masks, inv_freq) + ((cu_entries,) if cu_entries is not None else ())
    sig = _signature(inputs, (block_size, with_table))
    if sig is None:
        return _pack(block_ids, offsets, masks, block_size, inv_freq, with_table, cu_entries, bounds)
    hit = _CACHE.get(id(block_ids))
    if hit is not None and hit[0] == sig and all(r() is t for r, t in zip(hit[1], inputs)):
        _CACHE.move_to_end(id(block_ids))
        return hit[2]
    packed = _pack(block_ids, offsets, masks, block_size, inv_freq, with_table, cu_entries, bounds)
    _CACHE[id(block_ids)] = (sig, tuple(weakref.ref(t) for t in inputs), packed)
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return packed


def _check_shapes(block_ids, offsets, masks) -> None:
    if not (block_ids.shape == offsets.shape == masks.shape) or block_ids.dim() != 1:
        raise ValueError(f"block_ids {tuple(block_ids.shape)}, offsets {tuple(offsets.shape)} and masks "
                         f"{tuple(masks.shape)} must be 1-D of one length")


def _launch_pack(block_ids, offsets, masks64, inv_freq, meta, table) -> None:
    n = block_ids.numel()
    if n:
        _pack_kernel[(triton.cdiv(n, PACK_BLOCK),)](
            block_ids.contiguous(), offsets.contiguous(), masks64, inv_freq.to(torch.float32).contiguous(),
            meta, table if table is not None else meta, n, D2=inv_freq.numel(), BLOCK=PACK_BLOCK,
            WRITE_TABLE=table is not None)


def _pack(block_ids, offsets, masks, block_size, inv_freq, with_table, cu_entries, bounds=None) -> PackedTable:
    _check_shapes(block_ids, offsets, masks)
    validate(block_size, block_ids, offsets, bounds)
    n = block_ids.numel()
    dev = block_ids.device
    d2 = inv_freq.numel()
    meta = torch.empty(n, dtype=torch.int64, device=dev)
    table = torch.empty((n, 2 * d2), dtype=torch.float32, device=dev) if with_table else None
    masks64 = masks.to(torch.int64).contiguous()
    _launch_pack(block_ids, offsets, masks64, inv_freq, meta, table)
    starts, cu_groups = offset_groups(offsets, cu_entries) if cu_entries is not None else (None, None)
    return PackedTable(meta=meta, masks=meta if block_size <= 16 else masks64, table=table,
                       group_starts=starts, cu_groups=cu_groups)


def empty_packed(n_entries: int, n_seqs: int, block_size: int, head_dim: int, device,
                 with_table: bool = True) -> PackedTable:
    """Buffers of a prefill PackedTable of n_entries entries over n_seqs sequences, for ``pack_into``."""
    meta = torch.zeros(n_entries, dtype=torch.int64, device=device)
    return PackedTable(
        meta=meta, masks=meta if block_size <= 16 else torch.zeros_like(meta),
        table=torch.zeros((n_entries, head_dim), dtype=torch.float32, device=device) if with_table else None,
        group_starts=torch.zeros(n_entries + 2, dtype=torch.int32, device=device),
        cu_groups=torch.zeros(n_seqs + 1, dtype=torch.int32, device=device))


def pack_into(out: PackedTable, block_ids, offsets, masks, block_size: int, inv_freq: torch.Tensor,
              cu_entries: torch.Tensor, bounds: tuple[int, int] | None = None) -> PackedTable:
    """Validate and pack a prefill block table into ``out``'s tensors (made by empty_packed for this
    many entries and sequences); nothing is cached or allocated that a kernel reads. Returns out.
    NOTE: with ``bounds`` given (see validate) it never syncs with the device."""
    _check_shapes(block_ids, offsets, masks)
    if block_ids.shape != out.meta.shape or cu_entries.shape != out.cu_groups.shape:
        raise ValueError(f"{block_ids.numel()} entries / cu_entries {tuple(cu_entries.shape)} do not fit a packed "
                         f"table of {out.meta.numel()} entries and {out.cu_groups.numel() - 1} sequences")
    if out.table is not None and out.table.shape[1] != 2 * inv_freq.numel():
        raise ValueError(f"packed table rows of {out.table.shape[1]} do not fit {inv_freq.numel()} frequencies")
    validate(block_size, block_ids, offsets, bounds)
    if out.mask_in_word != (block_size <= 16):
        raise ValueError(f"a packed table made for another block size than {block_size}")
    if not out.mask_in_word:
        out.masks.copy_(masks)
    _launch_pack(block_ids, offsets, masks.to(torch.int64).contiguous(), inv_freq, out.meta, out.table)
    offset_groups(offsets, cu_entries, out=(out.group_starts, out.cu_groups))
    return out


def empty_decode_packed(n_entries: int, block_size: int, head_dim: int, device, masks: torch.Tensor | None = None,
                        with_table: bool = True) -> PackedTable:
    """Buffers of a decode PackedTable (no offset groups) of n_entries entries, for ``pack_table_into``.
    ``masks`` (int64 [n_entries]) is the caller's own mask buffer: with block_size > 16 the kernel reads
    it in place (no copy per pack); else the masks live in the packed words."""
    meta = torch.zeros(n_entries, dtype=torch.int64, device=device)
    if block_size > 16:
        if masks is None:
            masks = torch.zeros_like(meta)
        elif masks.shape != meta.shape or masks.dtype != torch.int64 or not masks.is_contiguous():
            raise ValueError(f"masks must be contiguous int64 [{n_entries}], got {masks.dtype} {tuple(masks.shape)}")
    return PackedTable(
        meta=meta, masks=meta if block_size <= 16 else masks,
        table=torch.zeros((n_entries, head_dim), dtype=torch.float32, device=device) if with_table else None)


def pack_table_into(out: PackedTable, block_ids, offsets, masks, block_size: int, inv_freq: torch.Tensor,
                    bounds: tuple[int, int] | None = None) -> PackedTable:
    """Validate and pack a decode block table into ``out`` (made by empty_decode_packed for this many
    entries): one launch, over every entry of the buffers (entries past a caller's bounds are packed
    too, and never read). Inputs contiguous, any integer dtype (int64 inputs are read as they are:
    nothing is allocated). NOTE: with ``bounds`` given (see validate) it never syncs with the device,
    so a CUDA graph can capture it; the caller then owns the check that the bounds hold."""
    _check_shapes(block_ids, offsets, masks)
    if block_ids.shape != out.meta.shape or out.group_starts is not None:
        raise ValueError(f"{block_ids.numel()} entries do not fit a decode packed table of {out.meta.numel()}")
    if out.table is not None and out.table.shape[1] != 2 * inv_freq.numel():
        raise ValueError(f"packed table rows of {out.table.shape[1]} do not fit {inv_freq.numel()} frequencies")
    if out.mask_in_word != (block_size <= 16):
        raise ValueError(f"a packed table made for another block size than {block_size}")
    validate(block_size, block_ids, offsets, bounds)
    masks64 = masks.to(torch.int64).contiguous()
    if not out.mask_in_word and out.masks is not masks:
        out.masks.copy_(masks64)
    _launch_pack(block_ids, offsets, masks64, inv_freq, out.meta, out.table)
    return out
