"""The Triton attention backend: the deferred-RoPE paged kernels of kernels/paged_attention, reached only through
that package's public functions; each entry's offset is applied by rotating the query backwards once per offset
group ((R_m q)·(R_{o+j} k) == (R_{m-o} q)·(R_j k)), so nothing is re-rotated in memory. A pass the caller calls
plain causal (its keys are its own queries, in order: ``full``, a chunk computed alone, the layers before
CacheBlend's check layer) takes the torch backend's flash path instead. Triton is imported only by those who use
this backend (``paged_kernels``)."""

from __future__ import annotations

import functools

import torch

from kernels.paged_attention import MAX_OFFSET
from services.engine.attention.base import PAD_POS, Attention, StaticTable, cu_one
from services.engine.attention.torch_backend import TorchAttention


@functools.cache
def paged_kernels():
    """kernels.paged_attention.triton, imported on first use."""
    from kernels.paged_attention import triton as kt

    return kt


class TritonAttention(Attention):
    name = "triton"

    def __init__(self, pool, inv_freq, scale):
        super().__init__(pool, inv_freq.to(torch.float32).contiguous(), scale)
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
        kt, key = paged_kernels(), (id(table), id(q_pos))
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

    def static_prefill(self, fwd, t: int, e: int) -> "TritonStatic":
        return TritonStatic(fwd, t, e)

    def static_decode(self, fwd, inp, splits: int) -> "TritonDecode":
        return TritonDecode(fwd, inp, splits)

    def decode_splits(self, n_seqs: int, n_kv_heads: int, n_entries: int, device) -> int:
        return paged_kernels().decode_splits(n_seqs, n_kv_heads, n_entries, device)


class TritonStatic(StaticTable):
    """The Triton prefill kernel over the padded table: packed metadata, query positions (-1 for
    padded rows: they see nothing) and the cu bounds [0, t], [0, e] all at fixed addresses."""

    def __init__(self, fwd, t: int, e: int):
        super().__init__(fwd, t, e)
        kt = paged_kernels()
        dev = fwd.device
        self.q_pos = torch.full((t,), -1, dtype=torch.int32, device=dev)
        self.cu_q, self.cu_e = cu_one(t, dev), cu_one(e, dev)
        self.packed = kt.empty_packed(e, 1, fwd.pool.block_size, fwd.cfg.head_dim, dev,
                                      with_table=True)

    def fill(self, table) -> None:
        if table.max_offset > MAX_OFFSET:  # what packing inside the graph would not see (engine input checks it too)
            raise ValueError(f"position offset {table.max_offset} does not fit the kernels' offset field (0..{MAX_OFFSET})")
        self._fill_table(table)

    def prepare(self, pos: torch.Tensor) -> None:
        att = self.fwd.attention
        # packed inside the graph: every bound is checked on the host (block ids below the pool's size,
        # offsets checked in fill), so packing never syncs
        paged_kernels().pack_into(self.packed, self.id_rows[0], self.id_rows[1], self.masks, att.pool.block_size,
                          att.inv_freq, self.cu_e, bounds=(att.pool.num_blocks - 1, MAX_OFFSET))
        self.q_pos.copy_(torch.where(pos < PAD_POS, pos, -1))
        # every layer reads the same table and slot positions: the kernel's per-step key bounds once (and the
        # key floors, when this tail's calls cut future keys)
        self.key_hi, self.key_floor = paged_kernels().prefill_bounds_for(self.packed, att.pool.slot_pos, self.t)

    def __call__(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        att = self.fwd.attention
        out, _ = paged_kernels().paged_prefill_packed(q, self.q_pos, att.pool.k[layer], att.pool.v[layer], att.pool.slot_pos,
                                              self.packed, self.cu_q, att.inv_freq, att.scale, key_hi=self.key_hi,
                                              key_floor=self.key_floor)
        return out


class TritonDecode:
    """The Triton paged decode kernel per layer on its cu row, splits fixed; entries packed once a step."""

    def __init__(self, fwd, inp, splits: int):
        self.fwd, self.inp, self.splits = fwd, inp, splits
        kt = paged_kernels()
        if inp.packed is None:
            inp.packed = kt.empty_decode_packed(inp.cap, fwd.pool.block_size, fwd.cfg.head_dim, fwd.device,
                                                masks=inp.masks, with_table=True)

    def prepare(self) -> None:
        att, inp = self.fwd.attention, self.inp
        # bounds: ids are pool blocks, offsets were checked on the host by DecodeGraphs.run
        paged_kernels().pack_table_into(inp.packed, inp.ids, inp.offs, inp.masks, att.pool.block_size, att.inv_freq,
                                bounds=(att.pool.num_blocks - 1, MAX_OFFSET))

    def __call__(self, layer: int, q: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        att = self.fwd.attention
        out, _ = paged_kernels().paged_decode_packed(q, att.pool.k[layer], att.pool.v[layer], self.inp.packed, cu,
                                             att.inv_freq, att.scale, self.splits)
        return out
