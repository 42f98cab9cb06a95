"""RetroAttention (decode="retro"): Quest page selection, and the pages a step reads also correct the attention of
the sequence's last ``retro_window`` − 1 tokens, which re-embed and overwrite their K/V in the layers above.

Per sequence, an output cache (``Sequence.past``, a ``PastToken`` per token of the window, oldest first) holds at
every sparse layer the token's query, attention output and log-sum-exp, and the pages its query has seen: its own
selection and those of every later step. At a step, once the current query's pages S are selected at layer l, each
past token attends with its cached query to the pages of S it has not seen and that existed at its step (pages
made later hold only later tokens), and the two results merge by log-sum-exp:
    out = attention over the union of every page the past query has seen          (kernels/lse_merge)
so its output tends to what a larger budget would have given, at no extra read: S is read for the current token.

The corrected outputs then re-embed (cross-layer overwrite): past tokens join the step's batch after the first
sparse layer's attention, with their cached residual input to it and their corrected output, and run the layers
above with the current tokens: o-projection, residual, MLP, then the next layer's q|k|v, whose K/V overwrite the
past token's slot in its generated-token block (private to the sequence: shared chunk blocks are never written),
so later steps read the corrected keys and values. A past token's query stays the one its output was computed
with (what makes the merge exact); its K/V, and the page bounds of its block, are what the re-embedding changes.

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
        step = RetroStep(self, fwd, len(seqs), sum(len(s.past) for s in seqs))
        step.load(seqs)
        return step

    def graph_step(self, fwd, rows: int, dense):
        """The step a decode graph of ``rows`` sequences captures (graphs/decode.py; ``dense``: its dense layers'
        attention)."""
        return RetroStep(self, fwd, rows, rows * (self.retro_window - 1), dense)


@dataclass(slots=True)
class PastToken:
    """One token of a sequence's retro window. pos, block, slot: its position and where its K/V live; entries
    [S]: how many table entries (pages) its sequence had at each sparse layer at its step; h [hidden]: its residual
    input to the first sparse layer; q, out [S, Hq, D] and lse [S, Hq] fp32: its query and (corrected) attention at
    each sparse layer; sel [S, Hkv, K]: the pages (entry indices within its sequence, -1 padded) its step read."""

    pos: int
    block: int
    slot: int
    entries: torch.Tensor
    h: torch.Tensor
    q: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    sel: torch.Tensor


class RetroStep(QuestStep):
    """A RetroAttention step on fixed buffers (see QuestStep): ``rows`` current sequences and ``past`` past-token
    rows (a decode graph: rows x (window - 1), the rows a step lacks padded, inert: no entries, writes to the
    scratch block; the eager step: exactly its batch's)."""

    def __init__(self, policy: RetroDecode, fwd, rows: int, past: int, dense=None):
        self.lookback = policy.retro_window      # the generated tokens whose K this step may write
        super().__init__(policy, fwd, rows, dense)
        cfg, dev, dtype = fwd.cfg, fwd.device, fwd.pool.k[0].dtype
        s, hq, hkv, d = self.sparse_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        width = (policy.retro_window - 1) * self.budget_pages
        self.first, self.past_cap = policy.dense_layers, past
        z = lambda *shape, dt=dtype: torch.zeros(shape, dtype=dt, device=dev)   # noqa: E731
        # the past tokens, flattened over the step's sequences: row r is a past token of sequence seq_of[r], with
        # its outputs as the step found them (a step never writes these, so that running it twice, as a graph's
        # capture does, gives what running it once does)
        self.h_p, self.q_p, self.out_in = z(past, cfg.hidden_size), z(s, past, hq, d), z(s, past, hq, d)
        self.lse_in, self.entries_p = z(s, past, hq, dt=torch.float32), z(s, past, dt=torch.int64)
        self.seen = z(s, past, hkv, width, dt=torch.int64)      # pages each has seen (entry indices, -1 padded)
        self.seq_of, self.pos_p, self.block_p, self.slot_p = (z(past, dt=torch.int64) for _ in range(4))
        # What a step makes, by reference (no copies: in a decode graph, tensors its replays write again): per
        # sparse layer, this step's tokens' (q, out, lse, pages as entry indices within their sequence, cu) and the
        # past rows' corrected (out, lse, pages corrected [R, Hkv]); this step's residual input to the first.
        self.cur: list = [None] * s
        self.fixed: list = [None] * s
        self.h_cur = None
        self.past_tokens: list[PastToken] = []

    def load(self, seqs) -> None:
        super().load(seqs)
        fwd, bs = self.fwd, self.fwd.bs
        self.where = [(s.next_pos - 1, s.gen_blocks[(s.gen_count - 1) // bs], (s.gen_count - 1) % bs) for s in seqs]
        past = [(b, j, p) for b, s in enumerate(seqs) for j, p in enumerate(s.past)]
        self.past_tokens = [p for _, _, p in past]
        n, cap = len(past), self.past_cap
        if n > cap:
            raise RuntimeError(f"{n} past tokens for a retro step of {cap} rows")
        if not cap:
            return
        dev = fwd.device
        host = np.zeros((4, cap), dtype=np.int64)               # seq_of, pos, block, slot; padding: scratch block
        host[2] = fwd.scratch_block
        for r, (b, _, p) in enumerate(past):
            host[:, r] = (b, p.pos, p.block, p.slot)
        for buf, row in zip((self.seq_of, self.pos_p, self.block_p, self.slot_p), host_to_device(host, torch.long,
                                                                                                  dev)):
            buf.copy_(row)
        for buf in (self.h_p, self.q_p, self.out_in, self.entries_p):
            buf.zero_()
        self.lse_in.fill_(float("-inf"))
        self.seen.fill_(-1)
        if not n:
            return
        tokens = self.past_tokens
        self.h_p[:n] = torch.stack([p.h for p in tokens])
        self.q_p[:, :n] = torch.stack([p.q for p in tokens], 1)
        self.out_in[:, :n] = torch.stack([p.out for p in tokens], 1)
        self.lse_in[:, :n] = torch.stack([p.lse for p in tokens], 1)
        self.entries_p[:, :n] = torch.stack([p.entries for p in tokens], 1)
        # what each past query has seen: its own step's pages and every later step's
        for r, (b, j, _) in enumerate(past):
            own = torch.cat([t.sel for t in seqs[b].past[j:]], -1)             # [S, Hkv, m*K]
            self.seen[:, r, :, :own.shape[-1]] = own

    def attend(self, layer, q, table, cu_entries):
        out = super().attend(layer, q, table, cu_entries)
        if layer < self.first:
            return out
        i = layer - self.first
        self.cur[i] = (q, out, self.lse, self.sel, cu_entries)
        if self.past_cap:
            self.fixed[i] = self._correct(i, table, cu_entries)
        return out

    def _correct(self, i: int, table, cu: torch.Tensor):
        """Past rows' attention at sparse layer i: their output merged with what they get from this step's pages
        that they have not seen and that existed at their step -> (out, lse, pages corrected [R, Hkv]); one or two
        launches (kernels/sparse/retro.py)."""
        fwd = self.fwd
        pool, model, layer = fwd.pool, fwd.model, self.first + i
        return sparse.retro_attention(
            self.q_p[i], pool.k[layer], pool.v[layer], table.block_ids, table.offsets, table.masks, self.sel,
            self.seq_of, self.entries_p[i], self.seen[i], cu, self.out_in[i], self.lse_in[i], model.inv_freq,
            model.scale, backend=fwd.backend)

    def join(self, layer, h):
        if layer != self.first:
            return None
        self.h_cur = h
        if not self.past_cap:
            return None
        return PastRows(self.h_p, self.fixed[0][0], self.pos_p, self.block_p, self.slot_p)

    def attend_past(self, layer, table, cu_entries):
        return self.fixed[layer - self.first][0]

    def corrections(self, n):
        if not self.past_cap:
            return None
        per_row = torch.stack([f[2] for f in self.fixed]).sum((0, 2), dtype=torch.int64)      # [R]
        return torch.zeros(max(n, 1), dtype=torch.int64, device=per_row.device).index_add_(0, self.seq_of,
                                                                                         per_row)[:n]

    def end(self) -> None:
        window = self.policy.retro_window - 1
        if window:
            self._push(window)
        super().end()   # the stats: a copy to the host, which waits for the device while it makes the records

    def _push(self, window: int) -> None:
        """This step's tokens into their sequences' windows (the oldest out), the past tokens' corrected outputs
        into their records."""
        n = len(self.seqs)
        # new tensors (stacks): what the records keep must outlive the buffers a decode graph's next replay writes.
        # A stack a kind over all sparse layers, then one slice and one unbind: a few calls a step, not a few a
        # layer and a sequence (each call is a turn of the interpreter lock a decode worker's threads share)
        q, out, lse, sel = (torch.stack([c[k] for c in self.cur], 1)[:n] for k in range(4))   # [n, S, ...]
        cu = torch.stack([c[4] for c in self.cur], 1).long()                                   # [b + 1, S]
        entries, h = (cu[1:] - cu[:-1])[:n], self.h_cur[:n].clone()
        sel = torch.where(sel >= 0, sel.long() - cu[:n, :, None, None], -1)   # entry indices within the sequence
        if self.past_tokens:
            m = len(self.past_tokens)
            out_p, lse_p = (torch.stack([f[k] for f in self.fixed], 1)[:m].unbind(0) for k in range(2))  # m x [S, ...]
            for token, o, l in zip(self.past_tokens, out_p, lse_p):   # the corrected outputs back into their records
                token.out, token.lse = o, l
        rows = zip(*(t.unbind(0) for t in (entries, h, q, out, lse, sel)))
        for s, (pos, block, slot), row in zip(self.seqs, self.where, rows):
            s.past.append(PastToken(pos, block, slot, *row))
            del s.past[:-window]
