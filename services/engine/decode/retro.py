"""RetroAttention (decode="retro"): Quest page selection, and the pages a step reads also correct the attention of
the sequence's last ``retro_window`` − 1 tokens, which re-embed and overwrite their K/V in the layers above.

Per sequence, an output cache (``Sequence.past``, a ``PastToken`` per token of the window, oldest first) holds at
every sparse layer the token's query, attention output and log-sum-exp, and the pages its query has seen: its own
selection and those of every later step. At a step, once the current query's pages S are selected at layer l, each
past token attends with its cached query to the pages of S it has not seen and that existed at its step (pages
made later hold only later tokens), and the two results merge by log-sum-exp:
    out = attention over the union of every page the past query has seen          (kernels/lse_merge)
so its output tends to what a larger budget would have given, at no extra read: S is read for the current token,
and one kernel (``quest_retro_attention``) attends each page of S once for the current token and its past tokens
(sequence b's j-th past token is past row b * (retro_window - 1) + j; rows a sequence lacks are inert).

The corrected outputs then re-embed (cross-layer overwrite): past tokens join the step's batch after the first
sparse layer's attention, with their cached residual input to it and their corrected output, and run the layers
above with the current tokens: o-projection, residual, MLP, then the next layer's q|k|v, whose K/V overwrite the
past token's slot in its generated-token block (private to the sequence: shared chunk blocks are never written),
so later steps read the corrected keys and values. A past token's query stays the one its output was computed
with (what makes the merge exact); its K/V, and the page bounds of its block, are what the re-embedding changes.

The windows live on the device (``RetroRecords``): a record per token of a window, its query, output, log-sum-exp,
pages and residual input at every sparse layer. A step reads its past tokens' records and writes this step's tokens'
records and the past tokens' corrected ones into records it takes anew, all within the step (a decode graph replays
the gathers and writes with the rest); the host keeps only which record is whose (``PastToken``), and gives the old
ones back after the step. Reading and writing apart keeps a step idempotent, as a graph's capture needs (it runs the
step twice).

``retro_window`` = 1 keeps no past token: Quest.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels import sparse
from services.checks import check_int
from services.engine.decode.policy import PastRows
from services.engine.decode.quest import QuestDecode, QuestStep
from services.engine.kv.block_table import host_to_device

MAX_WINDOW = 16


@dataclass(frozen=True, slots=True)
class RetroDecode(QuestDecode):
    """Quest's budget_tokens and dense_layers; retro_window: the tokens whose attention a step corrects, itself
    included (1..16; the paper's main results use 2)."""

    retro_window: int = 2
    name = "retro"

    def __post_init__(self) -> None:
        QuestDecode.__post_init__(self)
        check_int("retro_window", self.retro_window, 1, MAX_WINDOW)

    def check(self, block_size: int, num_layers: int) -> None:
        QuestDecode.check(self, block_size, num_layers)
        if self.dense_layers >= num_layers:
            raise ValueError(f"dense_layers must leave a sparse layer of the model's {num_layers} for retro, got "
                             f"{self.dense_layers}")

    def begin(self, fwd, seqs):
        # past rows in quest_retro_attention's layout: window - 1 a sequence, the ones a sequence lacks inert (so the
        # eager step runs the kernel a decode graph does, before the windows fill too)
        step = RetroStep(self, fwd, len(seqs), len(seqs) * (self.retro_window - 1))
        step.load(seqs)
        return step

    def graph_step(self, fwd, rows: int, dense):
        """The step a decode graph of ``rows`` sequences captures (graphs/decode.py; ``dense``: its dense layers'
        attention)."""
        return RetroStep(self, fwd, rows, rows * (self.retro_window - 1), dense)


class RetroRecords:
    """The RetroAttention windows of an engine's sequences of one shape (``sparse_layers``, ``budget_pages``), on the
    device, a record per token: h [C, hidden] (its residual input to the first sparse layer), q and out [S, C, Hq, D]
    (its query and, corrected so far, attention output at each sparse layer), lse [S, C, Hq] fp32, sel [S, C, Hkv, K]
    int64 (the pages its own step read, as entry indices within its sequence, -1 padded) and entries [S, C] int64
    (its sequence's table entries at its step). Record ``EMPTY`` is what a padded past row reads (no pages, lse
    -inf) and is never written; ``SINK`` takes padded rows' writes. ``take``/``give`` hand records out on the host;
    growing moves every tensor (``version`` counts the moves: a graph captured before one captures again)."""

    EMPTY, SINK = 0, 1

    def __init__(self, fwd, sparse_layers: int, budget_pages: int, capacity: int = 64):
        cfg = fwd.cfg
        self.dims = (sparse_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, budget_pages, cfg.hidden_size)
        self.device, self.dtype = fwd.device, fwd.pool.k[0].dtype
        self.version = 0
        self.capacity = 0
        self.free: list[int] = []
        # per sequence (by id), the records a step took for it and has not handed over yet: a step that fails between
        # load and end leaves them here, and they are given back at its sequence's next step or release
        self.pending: dict[int, list[int]] = {}
        self._grow(max(capacity, 3))

    def _grow(self, capacity: int) -> None:
        s, hq, hkv, d, k, hidden = self.dims
        dev, dt, old = self.device, self.dtype, self.capacity
        new = {"h": torch.zeros(capacity, hidden, dtype=dt, device=dev),
               "q": torch.zeros(s, capacity, hq, d, dtype=dt, device=dev),
               "out": torch.zeros(s, capacity, hq, d, dtype=dt, device=dev),
               "lse": torch.full((s, capacity, hq), float("-inf"), dtype=torch.float32, device=dev),
               "sel": torch.full((s, capacity, hkv, k), -1, dtype=torch.int64, device=dev),
               "entries": torch.zeros(s, capacity, dtype=torch.int64, device=dev)}
        if old:
            new["h"][:old] = self.h
            for name in ("q", "out", "lse", "sel", "entries"):
                new[name][:, :old] = getattr(self, name)
            self.version += 1
        self.h, self.q, self.out, self.lse, self.sel, self.entries = (new[n] for n in ("h", "q", "out", "lse", "sel",
                                                                                       "entries"))
        self.free += range(capacity - 1, max(old, self.SINK + 1) - 1, -1)   # popped lowest first
        self.capacity = capacity

    def take(self, n: int) -> list[int]:
        """``n`` free records (the tensors grow, doubling, when too few are free)."""
        if len(self.free) < n:
            self._grow(max(2 * self.capacity, self.capacity + n - len(self.free)))
        return [self.free.pop() for _ in range(n)]

    def give(self, records) -> None:
        """Records no window holds any more (their data is left as it is: a later step overwrites it)."""
        self.free += records

    def settle(self, seq) -> None:
        """Give back what a step took for ``seq`` and never handed over (it failed before its end)."""
        stale = self.pending.pop(id(seq), None)
        if stale:
            self.give(stale)

    @property
    def nbytes(self) -> int:
        """Device bytes of its tensors (outside the KV pool's budget)."""
        return sum(t.numel() * t.element_size() for t in (self.h, self.q, self.out, self.lse, self.sel, self.entries))

    @property
    def held(self) -> int:
        """Records in windows or taken by a step (the empty and sink records not counted)."""
        return self.capacity - 2 - len(self.free)


def records_for(fwd, sparse_layers: int, budget_pages: int) -> RetroRecords:
    """The engine's records for windows of this shape, made on first use."""
    key = (sparse_layers, budget_pages)
    rec = fwd.retro_records.get(key)
    if rec is None:
        rec = fwd.retro_records[key] = RetroRecords(fwd, sparse_layers, budget_pages)
    return rec


def clear_window(fwd, seq) -> None:
    """Forget a sequence's window, its records given back, and those a failed step took for it (when it is released
    or starts decoding anew)."""
    for token in seq.past:
        token.records.give([token.record])
    seq.past.clear()
    for rec in fwd.retro_records.values():
        rec.settle(seq)


@dataclass(slots=True)
class PastToken:
    """One token of a sequence's retro window: pos, block, slot (its position, where its K/V live) and the record
    holding its state (``records``' row ``record``). Its record's fields, per sparse layer, as views: entries [S],
    h [hidden], q, out [S, Hq, D], lse [S, Hq], sel [S, Hkv, K]."""

    pos: int
    block: int
    slot: int
    record: int
    records: RetroRecords

    @property
    def entries(self) -> torch.Tensor:
        return self.records.entries[:, self.record]

    @property
    def h(self) -> torch.Tensor:
        return self.records.h[self.record]

    @property
    def q(self) -> torch.Tensor:
        return self.records.q[:, self.record]

    @property
    def out(self) -> torch.Tensor:
        return self.records.out[:, self.record]

    @property
    def lse(self) -> torch.Tensor:
        return self.records.lse[:, self.record]

    @property
    def sel(self) -> torch.Tensor:
        return self.records.sel[:, self.record]


class RetroStep(QuestStep):
    """A RetroAttention step on fixed buffers (see QuestStep): ``rows`` current sequences and ``past`` past-token
    rows (a decode graph: rows x (window - 1), the rows a step lacks padded, inert: the empty record, no entries,
    writes to the scratch block and the sink record; the eager step: exactly its batch's)."""

    def __init__(self, policy: RetroDecode, fwd, rows: int, past: int, dense=None):
        self.lookback = policy.retro_window      # the generated tokens whose K this step may write
        super().__init__(policy, fwd, rows, dense)
        self.window = policy.retro_window - 1
        self.first, self.past_cap = policy.dense_layers, past
        self.records = records_for(fwd, self.sparse_layers, self.budget_pages)
        self.version = self.records.version
        # what the host says each step, in one copy: per past row its sequence's row, position, block, slot, record
        # read and record written; per current row the record written; per past row the records whose pages it has
        # seen (its own and every later token's of its window)
        w = max(self.window, 1)
        self.index = torch.zeros(6 * past + rows + past * w, dtype=torch.int64, device=fwd.device)
        self.seq_of, self.pos_p, self.block_p, self.slot_p, self.past_src, self.past_dst = (
            self.index[i * past:(i + 1) * past] for i in range(6))
        self.cur_dst = self.index[6 * past:6 * past + rows]
        self.seen_src = self.index[6 * past + rows:].view(past, w)
        # made within the step: the past rows' state (gathered at the first sparse layer), and per sparse layer this
        # step's tokens' (q, out, lse, pages, cu) and the past rows' corrected (out, lse, pages corrected [R, Hkv])
        self.h_p = self.q_p = self.out_in = self.lse_in = self.sel_p = self.entries_p = self.seen = None
        self.cur: list = [None] * self.sparse_layers
        self.fixed: list = [None] * self.sparse_layers
        self.h_cur = None
        self.taken: list[int] = []

    def load(self, seqs) -> None:
        super().load(seqs)
        fwd, bs = self.fwd, self.fwd.bs
        self.where = [(s.next_pos - 1, s.gen_blocks[(s.gen_count - 1) // bs], (s.gen_count - 1) % bs) for s in seqs]
        # sequence b's j-th past token is past row b * (window - 1) + j (kernels/sparse/retro.py's layout)
        past = [(b, s, j, p) for b, s in enumerate(seqs) for j, p in enumerate(s.past)]
        cap, rows = self.past_cap, self.rows_cap
        if past and (len(seqs) * self.window > cap or max(len(s.past) for s in seqs) > self.window):
            raise RuntimeError(f"{len(seqs)} sequences with up to {max(len(s.past) for s in seqs)} past tokens for a "
                               f"retro step of {cap} past rows, {self.window} a sequence")
        if not self.window:
            return
        for s in seqs:
            self.records.settle(s)
        self.taken = self.records.take(len(seqs) + len(past))
        w = max(self.window, 1)
        host = np.zeros(len(self.index), dtype=np.int64)
        cols = host[:6 * cap].reshape(6, cap)        # seq_of, pos, block, slot, src, dst; padding: inert rows
        cols[0] = np.arange(cap) // max(self.window, 1)
        cols[2], cols[4], cols[5] = fwd.scratch_block, RetroRecords.EMPTY, RetroRecords.SINK
        cur = host[6 * cap:6 * cap + rows]
        cur[:] = RetroRecords.SINK
        cur[:len(seqs)] = self.taken[:len(seqs)]
        seen = host[6 * cap + rows:].reshape(cap, w)
        seen[:] = RetroRecords.EMPTY
        for b, s in enumerate(seqs):
            self.records.pending[id(s)] = [self.taken[b]]
        for n, (b, s, j, p) in enumerate(past):
            r = b * self.window + j
            cols[:, r] = (b, p.pos, p.block, p.slot, p.record, self.taken[len(seqs) + n])
            self.records.pending[id(s)].append(self.taken[len(seqs) + n])
            later = s.past[j:]
            seen[r, :len(later)] = [t.record for t in later]
        self.index.copy_(host_to_device(host, torch.long, fwd.device))   # in place: a graph reads this very buffer

    def stale(self) -> bool:
        return self.records.version != self.version

    def captured(self) -> None:
        self.version = self.records.version

    def _attend(self, layer, q, table, cu_entries):
        if layer < self.first or not self.past_cap:
            out = super()._attend(layer, q, table, cu_entries)
        else:
            out = self._attend_both(layer, q, table, cu_entries)
        if layer >= self.first:
            self.cur[layer - self.first] = (q, out, self.lse, self.sel, cu_entries)
        return out

    def _attend_both(self, layer, q, table, cu_entries):
        """A sparse layer with past rows: the pages this step selects, read once for the current rows' attention and
        the past rows' correction (their output merged with what they get from the selected pages they have not
        seen and that existed at their step: ``fixed`` = (out, lse, pages corrected [R, Hkv])); one launch, two
        when the selection is split (kernels/sparse/retro.py)."""
        i = layer - self.first
        if i == 0:
            self._gather()
        self._select(layer, q, table, cu_entries)
        fwd = self.fwd
        pool, model = fwd.pool, fwd.model
        out, self.lse, *fixed = sparse.quest_retro_attention(
            q, self.q_p[i], pool.k[layer], pool.v[layer], table.block_ids, table.offsets, table.masks, self.sel,
            self.count, self.entries_p[i], self.seen[i], cu_entries, self.out_in[i], self.lse_in[i], model.inv_freq,
            model.scale, backend=fwd.backend)
        self.fixed[i] = tuple(fixed)
        return out

    def _gather(self) -> None:
        """The past rows' records (within the step: a graph gathers them at every replay)."""
        rec, src = self.records, self.past_src
        s, _, hkv, _, k, _ = rec.dims
        self.h_p = rec.h.index_select(0, src)
        self.q_p, self.out_in, self.lse_in, self.sel_p, self.entries_p = (
            t.index_select(1, src) for t in (rec.q, rec.out, rec.lse, rec.sel, rec.entries))
        r, w = self.seen_src.shape
        self.seen = (rec.sel.index_select(1, self.seen_src.reshape(-1)).view(s, r, w, hkv, k).transpose(2, 3)
                     .reshape(s, r, hkv, w * k))

    def join(self, layer, h):
        if layer != self.first:
            return None
        self.h_cur = h
        if not self.past_cap:
            return None
        return PastRows(self.h_p, self.fixed[0][0], self.pos_p, self.block_p, self.slot_p)

    def attend_past(self, layer, table, cu_entries):
        return self.fixed[layer - self.first][0]

    def corrections(self) -> torch.Tensor | None:
        if not self.past_cap:
            return None
        per_row = torch.stack([f[2] for f in self.fixed]).sum((0, 2), dtype=torch.int64)      # [R]
        return torch.zeros(self.rows_cap, dtype=torch.int64, device=per_row.device).index_add_(0, self.seq_of,
                                                                                              per_row)

    def _finish(self) -> None:
        super()._finish()
        if self.window:
            self._write()

    def _write(self) -> None:
        """This step's tokens' records and the past tokens' corrected ones, each into the record the host took for
        it (within the step: a graph writes them at every replay, and a replay reads none of them)."""
        rec, dst = self.records, self.cur_dst
        q, out, lse, sel = (torch.stack([c[k] for c in self.cur]) for k in range(4))   # [S, rows, ...]
        cu = torch.stack([c[4] for c in self.cur]).long()                              # [S, rows + 1]
        rows = q.shape[1]
        sel = torch.where(sel >= 0, sel.long() - cu[:, :rows, None, None], -1)   # entry indices within the sequence
        for t, v in ((rec.q, q), (rec.out, out), (rec.lse, lse), (rec.sel, sel), (rec.entries, cu[:, 1:] - cu[:, :-1])):
            t.index_copy_(1, dst, v)
        rec.h.index_copy_(0, dst, self.h_cur)
        if self.past_cap:
            dst = self.past_dst
            out_p, lse_p = (torch.stack([f[k] for f in self.fixed]) for k in range(2))
            for t, v in ((rec.q, self.q_p), (rec.out, out_p), (rec.lse, lse_p), (rec.sel, self.sel_p),
                         (rec.entries, self.entries_p)):
                t.index_copy_(1, dst, v)
            rec.h.index_copy_(0, dst, self.h_p)

    def end(self) -> None:
        if self.window:
            self._advance()
        super().end()   # the stats: a copy to the host, which waits for the device

    def _advance(self) -> None:
        """On the host: each past token now lives in its corrected record, this step's tokens join their windows
        (the oldest out), and the records no window holds are given back."""
        rec, seqs = self.records, self.seqs
        cur, fixed = self.taken[:len(seqs)], iter(self.taken[len(seqs):])
        old = []
        for s, (pos, block, slot), record in zip(seqs, self.where, cur):
            rec.pending.pop(id(s), None)
            for token in s.past:
                old.append(token.record)
                token.record = next(fixed)
            s.past.append(PastToken(pos, block, slot, record, rec))
            old += [t.record for t in s.past[:-self.window]]
            del s.past[:-self.window]
        rec.give(old)
        self.taken = []
