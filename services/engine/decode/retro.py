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

import torch

from kernels import sparse
from kernels.lse_merge import merge_attention
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
        return RetroStep(self, fwd, seqs)


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
    def __init__(self, policy: RetroDecode, fwd, seqs):
        self.lookback = policy.retro_window      # the generated tokens whose K this step may write
        super().__init__(policy, fwd, seqs)
        dev, d = fwd.device, policy.dense_layers
        n_layers = fwd.cfg.num_layers
        self.first = d
        bs = fwd.bs
        # this step's tokens: where they live and how many pages each sparse layer shows them
        self.cur_pos = [s.next_pos - 1 for s in seqs]
        self.cur_block = [s.gen_blocks[(s.gen_count - 1) // bs] for s in seqs]
        self.cur_slot = [(s.gen_count - 1) % bs for s in seqs]
        self.cur_entries = torch.tensor([[s.layer_tables[i].num_entries + len(s.gen_blocks)
                                          for i in range(d, n_layers)] for s in seqs], dtype=torch.int64)
        self.q_cur, self.out_cur, self.lse_cur, self.sel_cur = [], [], [], []
        self.h_cur = None
        # the past tokens, flattened over the group's sequences: row r is past token j of sequence seq_of[r]
        past = [(b, j, p) for b, s in enumerate(seqs) for j, p in enumerate(s.past)]
        self.rows = len(past)
        if not self.rows:
            return
        self.seq_of = host_to_device([b for b, _, _ in past], torch.long, dev)
        tokens = [p for _, _, p in past]
        self.h_p = torch.stack([p.h for p in tokens])                      # [R, hidden]
        self.q_p = torch.stack([p.q for p in tokens], 1)                   # [S, R, Hq, D]
        self.out_p = torch.stack([p.out for p in tokens], 1)
        self.lse_p = torch.stack([p.lse for p in tokens], 1)               # [S, R, Hq]
        self.entries_p = torch.stack([p.entries for p in tokens], 1).to(dev)   # [S, R]
        # what each past query has seen: its own step's pages and every later step's, [S, R, Hkv, W*K] (-1 pad)
        k = self.budget_pages
        width = (policy.retro_window - 1) * k
        seen = []
        for b, j, p in past:
            later = seqs[b].past[j:]
            own = torch.cat([t.sel for t in later], -1)                    # [S, Hkv, n*K]
            seen.append(torch.nn.functional.pad(own, (0, width - own.shape[-1]), value=-1))
        self.seen = torch.stack(seen, 1)
        self.pos_p = host_to_device([p.pos for p in tokens], torch.long, dev)
        self.block_p = host_to_device([p.block for p in tokens], torch.long, dev)
        self.slot_p = host_to_device([p.slot for p in tokens], torch.long, dev)
        self.attn_p = None

    def attend(self, layer, q, table, cu_entries):
        out = super().attend(layer, q, table, cu_entries)
        if layer < self.first:
            return out
        i = layer - self.first
        starts = cu_entries[:-1].long()[:, None, None]
        local = torch.where(self.sel >= 0, self.sel.long() - starts, -1)    # [B, Hkv, K] within each sequence
        self.q_cur.append(q)
        self.out_cur.append(out)
        self.lse_cur.append(self.lse)
        self.sel_cur.append(local)
        if self.rows:
            self._correct(i, local, table, cu_entries)
        return out

    def _correct(self, i: int, local: torch.Tensor, table, cu_entries) -> None:
        """Past rows' attention at sparse layer i: their output merged with what they get from this step's pages
        that they have not seen."""
        fwd = self.fwd
        pool, model, layer = fwd.pool, fwd.model, self.first + i
        cand = local[self.seq_of]                                            # [R, Hkv, K]
        seen = self.seen[i]                                                  # [R, Hkv, W*K]
        new = (cand >= 0) & (cand < self.entries_p[i][:, None, None])
        new &= ~(cand[..., None] == seen[:, :, None, :]).any(-1)
        big = torch.iinfo(torch.int64).max
        order = torch.where(new, cand, big).sort(-1).values                   # the new pages first, ascending
        count = new.sum(-1).to(torch.int32)
        starts = cu_entries[:-1].long()[self.seq_of][:, None, None]
        sel = torch.where(order != big, order + starts, -1).to(torch.int32)
        o_sup, lse_sup = sparse.sparse_decode_attention(
            self.q_p[i], pool.k[layer], pool.v[layer], table.block_ids, table.offsets, table.masks, sel, count,
            model.inv_freq, model.scale, backend=fwd.backend)
        out, lse = merge_attention(torch.stack([self.out_p[i], o_sup]), torch.stack([self.lse_p[i], lse_sup]),
                                   backend=fwd.backend)
        self.out_p[i], self.lse_p[i] = out, lse
        self.attn_p = out
        self.corrected.append(torch.zeros(len(self.seqs), dtype=torch.int64, device=count.device).index_add_(
            0, self.seq_of, count.sum(1).long()))

    def join(self, layer, h):
        if layer != self.first:
            return None
        self.h_cur = h
        if not self.rows:
            return None
        return PastRows(self.h_p, self.attn_p, self.pos_p, self.block_p, self.slot_p)

    def attend_past(self, layer, table, cu_entries):
        return self.attn_p

    def end(self) -> None:
        super().end()
        window = self.policy.retro_window - 1
        if not window:
            return
        q, out = torch.stack(self.q_cur, 1), torch.stack(self.out_cur, 1)    # [B, S, Hq, D]
        lse, sel = torch.stack(self.lse_cur, 1), torch.stack(self.sel_cur, 1)
        if self.rows:
            # the corrected outputs back into their tokens' records
            for r, token in enumerate(t for s in self.seqs for t in s.past):
                token.out, token.lse = self.out_p[:, r], self.lse_p[:, r]
        for b, s in enumerate(self.seqs):
            s.past.append(PastToken(self.cur_pos[b], self.cur_block[b], self.cur_slot[b], self.cur_entries[b],
                                    self.h_cur[b], q[b], out[b], lse[b], sel[b]))
            del s.past[:-window]
