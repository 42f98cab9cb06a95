"""The plain-torch attention backend: keys gathered from the pool, rotated by their chunk's offset (fp32, cast
back), SDPA with a causal-by-global-position mask (or its flash path when the caller says the pass is plain
causal); the static forms gather every slot of the padded table and mask by a tensor built once per replay."""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from kernels.rope import gather_rotate, rotate
from services.engine.attention.base import Attention, StaticTable, visible_keys
from services.engine.kv.block_table import BlockTable


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

    def static_prefill(self, fwd, t: int, e: int) -> "TorchStatic":
        return TorchStatic(fwd, t, e)

    def static_decode(self, fwd, inp, splits: int) -> "TorchDecode":
        return TorchDecode(fwd, inp, splits)


class TorchStatic(StaticTable):
    """SDPA over every slot of the padded table (keys gathered and rotated by one fused op) with an
    additive mask [1, 1, t, e*BS] in the cache dtype: 0 where the slot is visible and its key position
    <= the query position, -inf elsewhere (built once per replay inside the graph, not per layer)."""

    def __init__(self, fwd, t: int, e: int):
        super().__init__(fwd, t, e)
        cuda = fwd.device.type == "cuda" and importlib.util.find_spec("triton") is not None
        self.gather_backend = "triton" if cuda else "torch"
        bs = fwd.pool.block_size
        self.bits = torch.arange(bs, dtype=torch.int64, device=fwd.device)
        self.mask = torch.zeros(1, 1, t, e * bs, dtype=fwd.pool.k[0].dtype, device=fwd.device)

    def fill(self, table) -> None:
        self._fill_table(table)

    def prepare(self, pos: torch.Tensor) -> None:
        pool = self.fwd.pool
        ids, offs = self.id_rows[0], self.id_rows[1]
        k_pos = (offs[:, None] + pool.slot_pos[ids]).reshape(-1)  # [e*BS]
        visible = ((self.masks[:, None] >> self.bits) & 1).bool().reshape(-1)
        allowed = visible[None, :] & (k_pos[None, :] <= pos[:, None])
        self.mask[0, 0].copy_(torch.where(allowed, 0.0, float("-inf")))

    def __call__(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        fwd = self.fwd
        pool, model = fwd.pool, fwd.model
        keys, vals = gather_rotate(pool.k[layer], pool.v[layer], self.id_rows[0], self.id_rows[1], model.inv_freq,
                                   backend=self.gather_backend)  # [e*BS, Hkv, D]
        group = q.shape[1] // keys.shape[1]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                             vals.transpose(0, 1)[None], attn_mask=self.mask,
                                             scale=model.scale, enable_gqa=group > 1)
        return out[0].transpose(0, 1)


class TorchDecode:
    """Every slot of every entry gathered with its keys rotated (one fused op on CUDA), then SDPA with
    an additive mask [B, C*BS]: 0 on the visible slots of the sequence's own entries, -inf elsewhere;
    a sequence with no entries sees slot 0 (no empty softmax row)."""

    def __init__(self, fwd, inp, splits: int):
        self.fwd, self.inp = fwd, inp
        dev = fwd.device
        self.gather_backend = "triton" if dev.type == "cuda" and importlib.util.find_spec("triton") else "torch"
        self.entry = torch.arange(inp.cap, device=dev)
        self.bits = torch.arange(fwd.pool.block_size, dtype=torch.int64, device=dev)

    def prepare(self) -> None:
        self.visible = ((self.inp.masks[:, None] >> self.bits) & 1).bool()  # [C, BS]

    def __call__(self, layer: int, q: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        fwd, inp = self.fwd, self.inp
        keys, vals = gather_rotate(fwd.pool.k[layer], fwd.pool.v[layer], inp.ids, inp.offs, fwd.model.inv_freq,
                                   backend=self.gather_backend)  # [C*BS, Hkv, D]
        lo, hi = cu[:-1].long(), cu[1:].long()
        own = (self.entry[None, :] >= lo[:, None]) & (self.entry[None, :] < hi[:, None])  # [B, C]
        allowed = (own[:, :, None] & self.visible[None]).reshape(q.shape[0], -1)
        allowed[:, 0] |= hi == lo
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
        group = q.shape[1] // keys.shape[1]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                             vals.transpose(0, 1)[None], attn_mask=mask, scale=fwd.model.scale,
                                             enable_gqa=group > 1)
        return out[0].transpose(0, 1)
