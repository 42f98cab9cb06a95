"""The engine's one attention interface, with a plain-torch and a Triton implementation.

Both see the same thing: the layer's paged K/V, the slot positions, and a request's BlockTable.
  - ``TorchAttention`` gathers the entries' keys, rotates shared-chunk keys by their offsets (fp32,
    cast back), builds the causal-by-global-position mask and calls SDPA; decode uses the twin.
  - ``TritonAttention`` calls the fused kernels in ``kernels/paged_attention``, which apply each
    entry's offset on the fly by rotating the query backwards once per offset group (the same math:
    (R_m q)·(R_{o+j} k) == (R_{m-o} q)·(R_j k)); nothing is re-rotated in memory. A pass whose caller
    says it is plain causal (its keys are its own queries, in order: ``full``, a chunk computed alone, the
    layers before CacheBlend's check layer) takes the torch backend's flash path instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.paged_attention import paged_decode_attention
from kernels.rope import rope_cos_sin, rotate
from services.engine.kv.block_table import BlockTable


class Attention:
    name = "base"

    def __init__(self, pool, inv_freq: torch.Tensor, scale: float):
        self.pool, self.inv_freq, self.scale = pool, inv_freq, scale

    def bounds(self, table: BlockTable) -> tuple[int, int]:
        """(largest block id, largest offset) of a table, known on the host: packing skips its sync."""
        return self.pool.num_blocks - 1, table.max_offset

    def prefill(self, layer: int, q: torch.Tensor, q_pos: torch.Tensor, table: BlockTable,
                causal: bool | None = None) -> torch.Tensor:
        """q [T, Hq, D] at global positions q_pos [T] -> out [T, Hq, D]. ``causal``: the caller's word that
        the table's visible keys, in entry order, are exactly q_pos (True) or are not (False); None: checked."""
        raise NotImplementedError

    def decode(self, layer: int, q: torch.Tensor, table: BlockTable, cu_entries: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, D], entries of sequence b in table[cu[b]:cu[b+1]] -> out [B, Hq, D]."""
        dev = q.device
        out, _ = paged_decode_attention(q, self.pool.k[layer], self.pool.v[layer], table.block_ids, table.offsets,
                                        table.masks, cu_entries.to(dev), self.inv_freq, self.scale, backend=self.name)
        return out


def visible_keys(pool, table: BlockTable, inv_freq: torch.Tensor, positions: bool = True):
    """The keys one table shows, gathered flat: (slot index [S] into a layer's [N*BS] view, global
    position [S] (None unless ``positions``), and the fp32 cos/sin [S, 1, D/2] of each key's offset, or
    None when no entry has one).
    Hidden twins and padding are left out, so they never enter a matmul. Their number S comes from the
    table's host-side count when it has one (no sync), else from the device (nonzero waits for it)."""
    n_slots = pool.slot_pos.shape[1]
    ids = table.block_ids.long()
    bits = torch.arange(n_slots, device=ids.device, dtype=torch.int64)
    shown = ((table.masks[:, None] >> bits) & 1).bool().reshape(-1)
    if table.visible is not None:
        keep = torch.nonzero_static(shown, size=table.visible).flatten()
    else:
        keep = torch.nonzero(shown).flatten()
    idx = (ids[:, None] * n_slots + bits[None, :]).reshape(-1)[keep]
    k_pos = (table.offsets.long()[:, None] + pool.slot_pos[ids].long()).reshape(-1)[keep] if positions else None
    if not table.max_offset:
        return idx, k_pos, None, None
    off = table.offsets.long()[:, None].expand(-1, n_slots).reshape(-1)[keep]
    cos, sin = rope_cos_sin(off, inv_freq)
    return idx, k_pos, cos[:, None, :], sin[:, None, :]


class _Prepared:
    """What a (table, query positions) pair needs at every layer, computed once per pass:
    the visible keys, and either the causal mask or the fact that the keys are exactly the
    queries in order (plain causal attention, the flash path)."""

    __slots__ = ("table", "q_pos", "idx", "cos", "sin", "mask", "causal", "_additive")

    def __init__(self, pool, table: BlockTable, q_pos: torch.Tensor, inv_freq: torch.Tensor,
                 causal: bool | None = None):
        self.table, self.q_pos = table, q_pos  # held so that their ids stay unique while memoised
        # plain causal attention needs no key positions: they are the queries'
        self.idx, k_pos, self.cos, self.sin = visible_keys(pool, table, inv_freq, positions=causal is not True)
        q = q_pos.long()
        if causal is None:  # checked on the device: two syncs
            causal = bool(k_pos.numel() == q.numel() and torch.equal(k_pos, q)
                          and (q.numel() < 2 or bool((q[1:] > q[:-1]).all())))
        self.causal = causal
        self.mask = None if self.causal else (k_pos[None, :] <= q[:, None])[None, None]  # [1, 1, T, S]
        self._additive = None

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The mask as 0 / -inf in ``dtype``, made once per pass: SDPA would convert a boolean one per layer."""
        if self._additive is None or self._additive.dtype != dtype:
            self._additive = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            self._additive.masked_fill_(~self.mask, float("-inf"))
        return self._additive


class TorchAttention(Attention):
    name = "torch"

    def __init__(self, pool, inv_freq, scale):
        super().__init__(pool, inv_freq, scale)
        self._memo: dict[tuple[int, int], _Prepared] = {}

    def _prepare(self, table, q_pos, causal) -> _Prepared:
        key = (id(table), id(q_pos))
        prep = self._memo.get(key)
        if prep is None:
            if len(self._memo) > 16:
                self._memo.clear()
            prep = self._memo[key] = _Prepared(self.pool, table, q_pos, self.inv_freq, causal)
        return prep

    def prefill(self, layer, q, q_pos, table, causal=None):
        prep = self._prepare(table, q_pos, causal)
        kc, vc = self.pool.k[layer], self.pool.v[layer]
        k = kc.view(-1, *kc.shape[2:])[prep.idx]  # [S, Hkv, D]
        v = vc.view(-1, *vc.shape[2:])[prep.idx]
        if prep.cos is not None:
            k = rotate(k, prep.cos, prep.sin)
        group = q.shape[1] // k.shape[1]
        qh = q.transpose(0, 1)[None]
        if prep.causal:
            out = F.scaled_dot_product_attention(qh, k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                                 is_causal=True, scale=self.scale, enable_gqa=group > 1)
        else:
            # masks rule out the flash kernel; the memory-efficient one takes them with heads expanded
            k = k.repeat_interleave(group, dim=1) if group > 1 else k
            v = v.repeat_interleave(group, dim=1) if group > 1 else v
            out = F.scaled_dot_product_attention(qh, k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                                 attn_mask=prep.additive_mask(qh.dtype), scale=self.scale)
        return out[0].transpose(0, 1)


class TritonAttention(Attention):
    name = "triton"

    def __init__(self, pool, inv_freq, scale):
        from kernels.paged_attention import triton as kt  # Triton is imported only by those who use it

        super().__init__(pool, inv_freq.to(torch.float32).contiguous(), scale)
        self._kt = kt
        # a (table, queries) pair is packed once per pass and the packed table reused at every layer
        self._memo: dict[tuple[int, int], tuple] = {}
        self._dense = TorchAttention(pool, self.inv_freq, scale)  # the flash path of plain causal passes

    def prefill(self, layer, q, q_pos, table, causal=None):
        if causal is True:
            # plain causal passes through TorchAttention's flash path: the keys gathered from the pool (a chunk's
            # offset applied by a rotation of the gathered copy) and SDPA with is_causal, which on an H100 is
            # cuDNN's flash kernel. Measured (bench/engine/README.md): the paged kernel spent 22.6 ms of a 3,136-token
            # full pass's GPU time in attention, cuDNN 6.5 ms
            return self._dense.prefill(layer, q, q_pos, table, causal=True)
        kt, key = self._kt, (id(table), id(q_pos))
        args = self._memo.get(key)
        if args is None:
            if len(self._memo) > 16:
                self._memo.clear()
            # bounds checked on the host, [0, n] made on the device: no sync with the GPU
            cu_q, cu_e = cu_one(q.shape[0], q.device), cu_one(table.num_entries, q.device)
            packed = kt.pack(table.block_ids, table.offsets, table.masks, self.pool.block_size, self.inv_freq,
                             with_table=True, cu_entries=cu_e, bounds=self.bounds(table))
            # the kernel's key bounds (and floors) once per pass too: slot positions are written before a pass's
            # first layer, as the torch backend's memo assumes
            bounds = kt.prefill_bounds_for(packed, self.pool.slot_pos, q.shape[0])
            args = self._memo[key] = (table, q_pos, q_pos.to(torch.int32), cu_q, packed, *bounds)
        _, _, pos32, cu_q, packed, key_hi, key_floor = args
        out, _ = kt.paged_prefill_packed(q, pos32, self.pool.k[layer], self.pool.v[layer], self.pool.slot_pos,
                                         packed, cu_q, self.inv_freq, self.scale, key_hi=key_hi, key_floor=key_floor)
        return out


def self_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Tokens attending their own fresh keys, in order, causally (SDPA's flash path; nothing gathered from the
    pool): q [T, Hq, D], k, v [T, Hkv, D] -> [T, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=True, scale=scale, enable_gqa=group > 1)
    return out[0].transpose(0, 1)


def cu_one(n: int, device) -> torch.Tensor:
    """int32 [0, n], the cu bounds of one sequence, made on the device (a tensor built from a Python
    list is copied from the host, and that copy waits for the GPU; so does ``cu[1] = n``, which copies
    a host scalar into one element)."""
    return torch.arange(2, dtype=torch.int32, device=device) * n


BACKENDS = {"torch": TorchAttention, "triton": TritonAttention}
