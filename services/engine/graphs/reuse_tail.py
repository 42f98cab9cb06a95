"""The ratio-0 reuse pass as one host-to-device copy and one graph replay.

At recompute ratio 0 only the suffix runs, against every chunk's cached KV (Block-Attention), so all
that the pass needs is known on the host before it starts: the suffix's ids, its positions and write
slots, and the block table (each chunk's shared blocks at its offset, then the suffix's private
blocks). ``pack`` writes them straight into one of the tail's pinned staging buffers, laid out exactly as
its device input buffer, padding included; one asynchronous copy loads the tail, whose graph embeds
the ids and records the suffix's slot positions itself. A caller that keeps the Sequence (decode,
hand-off) gets its table as a device copy of those inputs, made after the copy (one more launch);
``Engine.prefill``, which releases the sequence at once, does not. The general path
(blend.RequestTables, the embedding, StaticTail.fill) spends ~10 host ops and copies for the same; here
the host owes a short request's first token one numpy pass, one copy and a replay. Results are the same
bits: the same kernels on the same values.

Input buffer (int64, t token rows and e table entries, both buckets):
    [ids t | position t | write block t | write slot t | entry block e | entry offset e | entry mask e]
Padding as StaticTail's: rows at PAD_POS writing the scratch block, entries naming it with no slot shown.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from kernels.paged_attention import MAX_OFFSET
from services.engine.kv.block_table import BlockTable, chunk_rows, dense_run
from services.engine.graphs.tails import PAD_POS, T_BUCKET, KeyedTails, StaticTail, bucket, entry_bucket
from services.engine.request import Sequence



STAGES = 3  # pinned staging buffers a tail cycles through: a request refills one only after its copy is done


class StagedInputs:
    """A device int64 buffer of fixed size loaded by one asynchronous copy from one of STAGES pinned host
    buffers: ``stage()`` hands out the next host buffer to fill (waiting, rarely, for the copy that last read
    it), ``load()`` copies it in."""

    def __init__(self, size: int, device: torch.device):
        self.device_buffer = torch.zeros(size, dtype=torch.int64, device=device)
        self._cuda = device.type == "cuda"
        self._staged = [torch.empty(size, dtype=torch.int64, pin_memory=self._cuda) for _ in range(STAGES)]
        self._host = [b.numpy() for b in self._staged]
        self._done: list[torch.cuda.Event | None] = [None] * STAGES
        self._next = 0

    def stage(self) -> np.ndarray:
        done = self._done[self._next]
        if done is not None:
            done.synchronize()  # that buffer's copy is queued behind an earlier request's work
        return self._host[self._next]

    def load(self) -> None:
        k = self._next
        self.device_buffer.copy_(self._staged[k], non_blocking=True)
        if self._cuda:
            if self._done[k] is None:
                self._done[k] = torch.cuda.Event()
            self._done[k].record()
        self._next = (k + 1) % STAGES


class IdsTail(StaticTail):
    """A StaticTail of every layer whose inputs are one int64 buffer (layout above) of token ids, not
    hidden states: the embedding and the suffix's slot positions are part of the graph. ``stage()`` and
    ``load()`` fill it (StagedInputs)."""

    def __init__(self, fwd, t: int, e: int, graph_pool=None):
        super().__init__(fwd, 0, t, e, graph_pool)
        self.t, self.e = t, e
        self.staging = StagedInputs(4 * t + 3 * e, fwd.device)
        self.stage, self.load = self.staging.stage, self.staging.load
        self.inputs = self.staging.device_buffer
        self.ids = self.inputs[:t]
        self.tokens = self.inputs[t:4 * t].view(3, t)
        att = self.attention  # its table buffers become views of the inputs (its fill is never called)
        att.id_rows = self.inputs[4 * t:4 * t + 2 * e].view(2, e)
        att.masks = self.inputs[4 * t + 2 * e:]

    def table(self, m: int, max_offset: int, visible: int) -> BlockTable:
        """The request's table (its m real entries) as its own device copy of the loaded inputs."""
        t, e = self.t, self.e
        rows = self.inputs[4 * t:].clone().view(3, e)[:, :m]
        ids_offs = rows[:2].to(torch.int32)
        return BlockTable(ids_offs[0], ids_offs[1], rows[2], max_offset, visible, rows[:2])

    def _body(self) -> None:
        pos, block, slot = self.tokens
        self.h.copy_(self.fwd.model.embed(self.ids))
        # padded rows write the scratch block's slots; 0 there, as the pool holds it
        self.fwd.pool.slot_pos[block, slot] = torch.where(pos < PAD_POS, pos, 0).to(torch.int32)
        super()._body()


def ids_tails(fwd) -> KeyedTails:
    """IdsTail by (token bucket, entry bucket)."""
    return KeyedTails(lambda t, e: IdsTail(fwd, t, e, fwd.tails.graph_pool))


def pack(buf: np.ndarray, placed, suffix: list[int], s_blocks: list[int], bs: int, scratch: int, t: int,
         e: int) -> tuple[int, int, int]:
    """Write the IdsTail inputs (int64 [4t + 3e], layout above) of suffix tokens after the placed chunks
    into ``buf`` -> (the real entries' count m, the largest offset, the chunks' token count)."""
    n_s = len(suffix)
    n_chunk = sum(p.entry.length for p in placed)
    c_rows, rots, _ = chunk_rows(placed, bs)
    s_ids, _, s_masks, s_block, _ = dense_run(s_blocks, n_s, bs)
    n_c = c_rows.shape[1]
    m = n_c + len(s_blocks)
    ids, pos, block, slot = buf[:t], buf[t:2 * t], buf[2 * t:3 * t], buf[3 * t:4 * t]
    e_ids, e_offs, e_masks = buf[4 * t:4 * t + e], buf[4 * t + e:4 * t + 2 * e], buf[4 * t + 2 * e:]
    ids[:n_s] = suffix
    ids[n_s:] = 0
    pos[:n_s] = np.arange(n_chunk, n_chunk + n_s)
    pos[n_s:] = PAD_POS
    block[:n_s] = s_block
    block[n_s:] = scratch
    slot[:] = np.arange(t) % bs  # the suffix's slots, then the padded rows' scratch slots as StaticTail's
    e_ids[:n_c], e_offs[:n_c], e_masks[:n_c] = c_rows
    e_ids[n_c:m] = s_ids
    e_ids[m:] = scratch
    e_offs[n_c:] = 0
    e_masks[n_c:m] = s_masks
    e_masks[m:] = 0
    return m, max(rots, default=0), n_chunk


def reuse_tail_pass(fwd, placed, chunks, pinned, private, suffix, stats, keep_tables: bool = True):
    """blend_pass at ratio 0 with no copy, when the suffix fits a static tail -> (logits, Sequence).
    ``keep_tables``: the Sequence gets its per-layer table (decode, hand-off); else none (the caller only
    releases it)."""
    t0 = time.perf_counter()
    bs, n_s = fwd.bs, len(suffix)
    s_blocks = fwd.cache.allocate(-(-n_s // bs), for_cache=False)
    private += s_blocks
    n_entries = sum(len(p.entry.blocks) for p in placed) + len(s_blocks)
    t, e = bucket(n_s, T_BUCKET), entry_bucket(n_entries, bs)
    if fwd.id_tails is None:
        fwd.id_tails = ids_tails(fwd)
    tail = fwd.id_tails.get(t, e)
    m, max_offset, n_chunk = pack(tail.stage(), placed, suffix, s_blocks, bs, fwd.scratch_block, t, e)
    if max_offset > MAX_OFFSET:  # the engine's input check refuses such requests first
        raise ValueError(f"position offset {max_offset} does not fit the kernels' offset field (0..{MAX_OFFSET})")
    tail.load()
    tables = [tail.table(m, max_offset, n_chunk + n_s)] * fwd.cfg.num_layers if keep_tables else []
    fwd.id_tails.replays += 1
    h = tail.run()
    logits = fwd.model.logits(h[n_s - 1:n_s])[-1]
    stats.private_blocks_allocated += len(private)
    stats.forward_seconds = time.perf_counter() - t0
    tokens = {p.entry.key: c for p, c in zip(placed, chunks)}
    return logits, Sequence(tables, pinned, private, n_chunk + n_s, chunk_tokens=tokens)
