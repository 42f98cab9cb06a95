"""Quest decode (decode="quest"): each (sequence, KV head) attends only to the pages (KV blocks) whose key bounds say
they matter, within a budget of tokens; the first ``dense_layers`` layers attend densely.

Page metadata is position-agnostic: per page and KV head, the elementwise min and max of its keys as the pool holds
them (services/engine/kv/block_pool.py: ``kmin``/``kmax``), i.e. at chunk-local positions for a shared chunk's
blocks. A page placed at offset ``o`` is scored by the query rotated BACKWARDS by ``o`` (the deferred rotation the
attention kernels apply):
    (R_{m} q)·(R_{o+j} k) = (R_{m-o} q)·(R_j k)    so    score = Σ_i max(q'_i·kmax_i, q'_i·kmin_i),  q' = R_{-o} q
an upper bound of the page's best q·k wherever the chunk is placed. A page's score per KV head is the largest over
the query heads that share it (GQA). The page holding the newest token is always selected; the others by score.
The three kernels (scoring, selection, sparse attention) are kernels/sparse.

When the bounds are computed (``bound_sequence``, ``QuestStep``): a shared chunk's once while it is resident, by the
first sparse decode that reads it, over its written slots, so that every later request reuses them wherever it
places the chunk; a sequence's private prefill blocks (suffix, recomputed tokens) once when it starts decoding,
per layer over the slots that layer's table shows; its generated tokens' block at every step, after the step's K
is written (and, under RetroAttention, the blocks whose past tokens' K were overwritten).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import sparse
from services.checks import check_int
from services.engine.decode.policy import DecodePolicy, PolicyStep
from services.engine.kv.block_table import host_to_device


@dataclass(frozen=True, slots=True)
class QuestDecode(DecodePolicy):
    """budget_tokens: the keys a (sequence, KV head) attends per layer, in whole pages (at least one page);
    dense_layers: the first layers, which attend densely (Quest's default, 2)."""

    budget_tokens: int = 2048
    dense_layers: int = 2
    name = "quest"
    replays_graph = True   # a step of one quest policy: graphs/decode.py

    def __post_init__(self) -> None:
        check_int("budget_tokens", self.budget_tokens, 1)
        check_int("dense_layers", self.dense_layers, 0)

    def check(self, block_size: int, num_layers: int) -> None:
        """ValueError naming the field for a budget under one page, or more dense layers than the model has."""
        if self.budget_tokens < block_size:
            raise ValueError(f"budget_tokens must be at least one page ({block_size} tokens), got {self.budget_tokens}")
        if self.dense_layers > num_layers:
            raise ValueError(f"dense_layers must be at most the model's {num_layers} layers, got {self.dense_layers}")

    def prepare(self, fwd, seq) -> None:
        bound_sequence(fwd, seq)

    def begin(self, fwd, seqs):
        step = QuestStep(self, fwd, len(seqs))
        step.load(seqs)
        return step

    def graph_step(self, fwd, rows: int, dense):
        """The step a decode graph of ``rows`` sequences captures (graphs/decode.py; ``dense``: its dense layers'
        attention, (layer, q, table, cu) -> out)."""
        return QuestStep(self, fwd, rows, dense)


def bound_sequence(fwd, seq) -> None:
    """Compute the page bounds a sequence's sparse decode reads and nobody has computed: its chunks' (once per
    residency: ``ChunkEntry.bounded``) and its private prefill blocks' (per layer, over what that layer shows)."""
    pool, dev, bs = fwd.pool, fwd.device, fwd.bs
    fresh = [e for e in seq.pinned if not e.bounded]
    if fresh:   # every fresh chunk's blocks at once: a few kernels a layer, not a few per chunk and layer
        blocks = [b for e in fresh for b in e.blocks]
        fills = [min(bs, e.length - i * bs) for e in fresh for i in range(len(e.blocks))]
        pool.bound_dense(host_to_device(blocks, torch.long, dev), host_to_device(fills, torch.long, dev))
        for e in fresh:
            e.bounded = True
    if not seq.private_blocks:
        return
    private = host_to_device(seq.private_blocks, torch.long, dev)
    bits = torch.arange(bs, device=dev, dtype=torch.int64)
    picked: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # per distinct table object: its private rows
    for layer, table in enumerate(seq.layer_tables):
        if id(table) not in picked:
            rows = torch.isin(table.block_ids.long(), private).nonzero().squeeze(1)
            visible = ((table.masks[rows][:, None] >> bits) & 1).bool()
            picked[id(table)] = (table.block_ids[rows], visible)
        blocks, visible = picked[id(table)]
        pool.bound(layer, blocks, visible)


def generated_blocks(seqs, bs: int, lookback: int, capacity: int, scratch: int, device):
    """The generated-token blocks holding each sequence's last ``lookback`` tokens (this step's included), and their
    written slots, padded to ``capacity`` rows with the scratch block showing none: (block ids [capacity], visible
    bool [capacity, BS])."""
    blocks, fills = [], []
    for s in seqs:
        first, last = max(0, s.gen_count - lookback) // bs, (s.gen_count - 1) // bs
        for i in range(first, last + 1):
            blocks.append(s.gen_blocks[i])
            fills.append(min(bs, s.gen_count - i * bs))
    pad = capacity - len(blocks)
    fill = host_to_device(fills + [0] * pad, torch.long, device)
    return (host_to_device(blocks + [scratch] * pad, torch.long, device),
            torch.arange(bs, device=device)[None, :] < fill[:, None])


class QuestStep(PolicyStep):
    """One decode step of a group of Quest sequences, on buffers of a fixed capacity (``rows``: the sequences it
    can take) so that a decode graph (graphs/decode.py) captures it once and ``load``s each step's sequences into
    it; the eager step makes one of exactly its batch's size. After ``attend`` at a sparse layer, ``sel``/``count``
    hold the pages each row read and ``lse`` its log-sum-exp (RetroAttention builds on them)."""

    lookback = 1   # the generated tokens whose K this step writes: its own

    def __init__(self, policy: QuestDecode, fwd, rows: int, dense=None):
        super().__init__(policy, fwd, [])
        self.rows_cap = rows
        self.dense_attend = dense or (lambda layer, q, table, cu: fwd.attention.decode(layer, q, table, cu))
        self.budget_pages = policy.budget_tokens // fwd.bs
        self.sparse_layers = fwd.cfg.num_layers - min(policy.dense_layers, fwd.cfg.num_layers)
        self.blocks_per_row = (self.lookback - 1) // fwd.bs + 2
        # per sparse layer, the pages each row read [rows, Hkv], read back at the step's end
        self.reads: list = [None] * self.sparse_layers
        # the generated blocks this step writes K to, and their written slots (filled by ``load``)
        self.touched = torch.zeros(rows * self.blocks_per_row, dtype=torch.int64, device=fwd.device)
        self.touched_slots = torch.zeros((rows * self.blocks_per_row, fwd.bs), dtype=torch.bool, device=fwd.device)
        self.sel = self.count = self.lse = None
        self.tally = None   # [rows, 2] pages read and corrected, made after the last layer (``_finish``)

    def load(self, seqs) -> None:
        """This step's sequences (at most ``rows``; the rest of the rows are padding with no entries)."""
        fwd, policy = self.fwd, self.policy
        hkv, n_layers = fwd.cfg.num_kv_heads, fwd.cfg.num_layers
        self.seqs = seqs
        touched, slots = generated_blocks(seqs, fwd.bs, self.lookback, self.rows_cap * self.blocks_per_row,
                                          fwd.scratch_block, fwd.device)
        self.touched.copy_(touched)        # in place: a captured graph reads these very buffers
        self.touched_slots.copy_(slots)
        # per sequence, the pages a dense step reads and, as dense layers read them, the dense part of what this
        # step reads (host arithmetic); the sparse layers' reads are counted on the device
        self.visible = [s.decode_stats.visible(s, n_layers, hkv) for s in seqs]
        self.dense_read = [hkv * sum(s.layer_tables[i].num_entries + len(s.gen_blocks)
                                     for i in range(min(policy.dense_layers, n_layers))) for s in seqs]

    def attend(self, layer, q, table, cu_entries):
        out = self._attend(layer, q, table, cu_entries)
        if layer == self.fwd.cfg.num_layers - 1 and self.sparse_layers:
            self._finish()
        return out

    def _attend(self, layer, q, table, cu_entries):
        fwd, policy = self.fwd, self.policy
        if layer < policy.dense_layers:
            return self.dense_attend(layer, q, table, cu_entries)
        self._select(layer, q, table, cu_entries)
        pool, model = fwd.pool, fwd.model
        out, self.lse = sparse.sparse_decode_attention(q, pool.k[layer], pool.v[layer], table.block_ids,
                                                       table.offsets, table.masks, self.sel, self.count,
                                                       model.inv_freq, model.scale, backend=fwd.backend)
        return out

    def _select(self, layer, q, table, cu_entries) -> None:
        """A sparse layer's pages: the bounds of this step's written blocks, the scores, the top pages (``sel``,
        ``count``, counted in the step's reads)."""
        fwd = self.fwd
        pool, model, backend = fwd.pool, fwd.model, fwd.backend
        pool.bound(layer, self.touched, self.touched_slots)        # this step's K (and overwritten ones) written
        scores = sparse.page_scores(q, pool.kmin[layer], pool.kmax[layer], table.block_ids, table.offsets,
                                    table.masks, cu_entries, model.inv_freq, backend=backend)
        self.sel, self.count = sparse.select_pages(scores, cu_entries, self.budget_pages, backend=backend)
        self.reads[layer - self.policy.dense_layers] = self.count   # by reference: a graph's replays write it again

    def corrections(self) -> torch.Tensor | None:
        """Pages each row corrected, int64 [rows] on the device (RetroAttention), or None."""
        return None

    def _finish(self) -> None:
        """After the last layer's attention, within the step (a graph replays it): per row, the pages its sparse
        layers read and those it corrected, int64 [rows, 2]."""
        read = torch.stack(self.reads).sum((0, 2), dtype=torch.int64)
        fixed = self.corrections()
        self.tally = torch.stack([read, torch.zeros_like(read) if fixed is None else fixed], 1)

    def end(self) -> None:
        n = len(self.seqs)
        both = self.tally[:n].tolist() if self.sparse_layers else [(0, 0)] * n     # one copy a step
        for s, visible, dense, (pages, corrected) in zip(self.seqs, self.visible, self.dense_read, both):
            s.decode_stats.add(visible, dense + pages, corrected)
