"""The engine's one attention interface (``Attention``) and what its backends share.

A backend (torch_backend.py, triton_backend.py) owns every form its attention takes: eager prefill over a
request's BlockTable (``prefill``), the eager decode (``decode``), and the capturable forms the CUDA graphs replay
(``static_prefill`` over a padded table, ``static_decode`` over a decode step's fixed buffers). The graphs and
the passes reach attention only through this interface; only a backend calls its kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.paged_attention import paged_decode_attention
from kernels.rope import rope_cos_sin
from services.engine.kv.block_table import BlockTable

PAD_POS = 1 << 30  # padded query rows sit after every key: they see every visible one (never an empty row)



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

    def static_prefill(self, fwd, t: int, e: int) -> "StaticTable":
        """This backend's capturable prefill attention for ``t`` query rows over ``e`` padded table entries
        (graphs/tails.py's StaticTail replays it inside a CUDA graph)."""
        raise NotImplementedError

    def static_decode(self, fwd, inp, splits: int):
        """This backend's capturable decode attention over a decode graph's fixed inputs ``inp``
        (graphs/decode.py), with ``splits`` KV splits where the backend splits."""
        raise NotImplementedError

    def decode_splits(self, n_seqs: int, n_kv_heads: int, n_entries: int, device) -> int:
        """The KV splits a decode step of n_seqs sequences of n_entries entries each is captured with."""
        return 1

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


class StaticTable:
    """One request's block table padded to ``e`` entries in fixed int64 buffers (block ids and offsets
    ``id_rows`` [2, e], masks [e]); padding entries name the scratch block and show none of its slots.
    Filling costs two copies, plus one when the table shrank (stale entries become padding again)."""

    def __init__(self, fwd, t: int, e: int):
        self.fwd, self.t, self.e = fwd, t, e
        dev = fwd.device
        self.id_rows = torch.zeros(2, e, dtype=torch.int64, device=dev)
        self.id_rows[0] = fwd.scratch_block
        self.masks = torch.zeros(e, dtype=torch.int64, device=dev)
        self._pad = self.id_rows.clone()
        self._filled = 0   # entries that may hold another table's values

    def _fill_table(self, table) -> None:
        m = table.num_entries
        if m > self.e:
            raise RuntimeError(f"{m} entries do not fit a static tail of {self.e}")
        if table.id_rows is not None:
            self.id_rows[:, :m] = table.id_rows
        else:
            self.id_rows[0, :m] = table.block_ids
            self.id_rows[1, :m] = table.offsets
        self.masks[:m] = table.masks
        if m < self._filled:
            self.id_rows[:, m:self._filled] = self._pad[:, m:self._filled]
            self.masks[m:self._filled] = 0
        self._filled = m

    def prepare(self, pos: torch.Tensor) -> None:
        """Inside the graph, once per replay: what the layers' attention needs from the static inputs."""


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
