"""Decode steps replayed as CUDA graphs.

A decode step is one token per sequence through every layer: ~35 small kernels a layer, bound by
launches and Python, not by the GPU. ``DecodeGraph`` runs a whole step (slot positions, embedding,
every layer, logits) on fixed buffers whose shapes are a bucket (sequences padded to 1, 2, 4 .. 32,
block-table entries to a power of two), so one captured graph serves every step of its bucket:
  - one flat entry list holds every *view* of the step: the distinct batch tables its layers see (one
    for plain sequences; two or three across a blend's layers), each sequence's table followed by its
    generated blocks (as the eager step concatenates them), views back to back;
  - a row of entry bounds per layer, cu [L, B+1], says where each sequence's entries of that layer's
    view begin and end: which view a layer reads is data, not code, so one graph serves any mix;
  - ``fill`` (outside the graph) lays the step out on the host, from host copies of the tables
    (``HostTables``: one device-to-host copy when a sequence first decodes, none after) and the
    sequences' generated blocks (host lists), checks the bounds there, and copies it to the device
    from pinned memory, asynchronously: no host sync;
  - in the graph the entries are packed (``pack_table_into``) and each layer runs the Triton paged
    decode kernel on its cu row with a split count fixed per bucket (torch backend: every slot
    gathered and rotated, SDPA under a per-sequence mask built from the same cu row).
Padding is inert: a padded sequence has no entries (Triton: out 0; SDPA: one key, no empty softmax
row), reads token 0 at position 0 and writes its K/V to the reserved scratch block; entries past the
step's last are packed but never read. On the CPU the same code runs eagerly: that is how the tests
check it equals the eager step. Batches past the largest bucket and tables past ``max_entries`` run
eagerly (Forward.decode_step).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from kernels.options import current
from kernels.paged_attention import MAX_OFFSET, check_encodable
from kernels.rope import rope_cos_sin
from services.engine.decode import DENSE
from services.engine.decode.policy import count_dense
from services.engine.kv.block_table import BlockTable, full_mask
from services.engine.graphs.tails import capture

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
MIN_ENTRIES, MAX_ENTRIES = 256, 1 << 17  # entry buckets: powers of two in between
MAX_GRAPHS = 16
ROW = -(-(BATCH_BUCKETS[-1] + 1) // 4) * 4  # cu row length: rows 16-byte aligned (Triton specialises pointers)


class HostTables:
    """Host copies (int64 numpy ids, offsets, masks) of block tables by identity, kept while a step
    decodes a sequence that holds them (a sequence's tables never change once it holds them). A table
    built on the host brings its rows (``BlockTable.host_rows``) and costs no copy."""

    def __init__(self):
        self._held: dict[int, tuple] = {}
        self.copies = 0  # device-to-host copies made (each one waits for the GPU)

    def get(self, tables) -> dict[int, tuple]:
        """id(table) -> (table, ids, offsets, masks) for ``tables``; the rest is forgotten."""
        now, missing = {}, []
        for t in tables:
            if id(t) in now:
                continue
            hit = self._held.get(id(t))
            if hit is None or hit[0] is not t:
                rows = t.host_rows        # built on the host (an imported hand-off): no copy back
                hit = None if rows is None else (t, rows[0], rows[1], rows[2])
            now[id(t)] = hit
            if hit is None:
                missing.append(t)
        if missing:  # one copy (one sync) for every table new to this step
            self.copies += 1
            flat = torch.cat([torch.cat([t.block_ids.long(), t.offsets.long(), t.masks.long()])
                              for t in missing]).cpu().numpy()
            at = 0
            for t in missing:
                n = t.num_entries
                now[id(t)] = (t, flat[at:at + n], flat[at + n:at + 2 * n], flat[at + 2 * n:at + 3 * n])
                at += 3 * n
        self._held = now
        return now


@dataclass(frozen=True, slots=True)
class StepLayout:
    """One decode step on the host, all int64: tokens, pos, w_block, w_slot [n]; ids, offs, masks [E]
    (every view's entries back to back); cu [L, n+1], the bounds of sequence b's entries at layer l."""

    tokens: np.ndarray
    pos: np.ndarray
    w_block: np.ndarray
    w_slot: np.ndarray
    ids: np.ndarray
    offs: np.ndarray
    masks: np.ndarray
    cu: np.ndarray

    @property
    def n(self) -> int:
        return len(self.tokens)

    @property
    def total(self) -> int:
        return len(self.ids)


def layout(seqs, tokens, blocks, slots, positions, host: HostTables, num_layers: int, bs: int) -> StepLayout:
    """Lay out a step whose sequences already hold their new token (gen_count counts it)."""
    views: dict[tuple, int] = {}
    view_layer, view_of = [], []  # first layer of each view; view of each layer
    for layer, key in enumerate(zip(*(map(id, s.layer_tables[:num_layers]) for s in seqs))):
        if key not in views:
            views[key] = len(view_layer)
            view_layer.append(layer)
        view_of.append(views[key])
    tabs = host.get([s.layer_tables[layer] for layer in view_layer for s in seqs])
    gens, full = [], full_mask(bs)
    for s in seqs:  # the generated blocks, as BlockTable.for_run(gen_blocks, gen_count) lays them
        g = len(s.gen_blocks)
        masks = np.full(g, full, dtype=np.int64)
        if g:
            masks[-1] = full_mask(min(bs, s.gen_count - (g - 1) * bs))
        gens.append((np.asarray(s.gen_blocks, dtype=np.int64), np.zeros(g, dtype=np.int64), masks))
    parts: tuple[list, list, list] = ([], [], [])
    lens = []
    for layer in view_layer:
        for s, gen in zip(seqs, gens):
            _, *tab = tabs[id(s.layer_tables[layer])]
            for out, t, g in zip(parts, tab, gen):
                out += (t, g)
            lens.append(len(tab[0]) + len(gen[0]))
    ends = np.cumsum(lens, dtype=np.int64).reshape(len(view_layer), len(seqs))
    starts = np.concatenate([[0], ends[:-1, -1]])
    cu = np.concatenate([starts[:, None], ends], axis=1)[view_of]  # [L, n+1]
    i64 = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    return StepLayout(i64(tokens), i64(positions), i64(blocks), i64(slots), *(np.concatenate(p) for p in parts), cu)


class _Inputs:
    """Fixed device buffers of one entry capacity, shared by the graphs of every batch bucket: int64
    [tokens, pos, w_block, w_slot (32 each) | cu [L, ROW] | ids C | offs C | masks C], cu as int32 (made
    in the graph), and the backend's packed table. Two pinned host copies take turns; each is written
    again only once its last copy to the device is done."""

    def __init__(self, fwd, cap: int):
        layers, dev, top = fwd.cfg.num_layers, fwd.device, BATCH_BUCKETS[-1]
        self.cap, self.head = cap, 4 * top + layers * ROW
        self.dev = torch.zeros(self.head + 3 * cap, dtype=torch.int64, device=dev)
        d, h = self.dev, self.head
        self.tokens, self.pos, self.w_block, self.w_slot = (d[i * top:(i + 1) * top] for i in range(4))
        self.cu = d[4 * top:h].view(layers, ROW)
        self.ids, self.offs, self.masks = d[h:h + cap], d[h + cap:h + 2 * cap], d[h + 2 * cap:]
        self.cu32 = torch.zeros(layers, ROW, dtype=torch.int32, device=dev)
        self.packed = None  # made by the Triton attention
        cuda = dev.type == "cuda"
        self.stages = [torch.zeros(d.shape, dtype=torch.int64).pin_memory() for _ in range(2)] if cuda else [d]
        self.copied: list = [None] * len(self.stages)
        self.turn = 0
        self.pad_slots = np.arange(top, dtype=np.int64) % fwd.pool.block_size

    def fill(self, step: StepLayout, b: int, scratch: int) -> None:
        """Load a step for a graph of ``b`` sequences; rows n..b-1 padded, inert."""
        i = self.turn % len(self.stages)
        self.turn += 1
        if self.copied[i] is not None:
            self.copied[i].synchronize()  # that copy left two steps ago: done long since
        a = self.stages[i].numpy()
        n, top, h, e, cap = step.n, BATCH_BUCKETS[-1], self.head, step.total, self.cap
        for k, (src, pad) in enumerate(((step.tokens, 0), (step.pos, 0), (step.w_block, scratch),
                                        (step.w_slot, self.pad_slots[n:b]))):
            a[k * top:k * top + n] = src
            a[k * top + n:k * top + b] = pad
        cu = a[4 * top:h].reshape(-1, ROW)
        cu[:, :n + 1] = step.cu
        cu[:, n + 1:b + 1] = step.cu[:, n:n + 1]  # padded sequences: no entries
        a[h:h + e], a[h + cap:h + cap + e], a[h + 2 * cap:h + 2 * cap + e] = step.ids, step.offs, step.masks
        stage = self.stages[i]
        if stage is not self.dev:
            for lo, hi in ((0, h + e), (h + cap, h + cap + e), (h + 2 * cap, h + 2 * cap + e)):
                self.dev[lo:hi].copy_(stage[lo:hi], non_blocking=True)
            self.copied[i] = torch.cuda.Event()
            self.copied[i].record()


class DecodeGraph:
    """One bucket: ``b`` sequences over the entries of ``inp`` (its capacity); logits [b, vocab] fp32. ``policy``:
    the decode policy of every sequence of its steps: dense, or a sparse one whose step (``policy.graph_step``,
    services/engine/decode) is captured with it, on buffers its ``load`` fills before each replay."""

    def __init__(self, fwd, inp: _Inputs, b: int, splits: int, graph_pool=None, policy=DENSE):
        self.fwd, self.inp, self.b, self.splits = fwd, inp, b, splits
        self.attention = fwd.attention.static_decode(fwd, inp, splits)
        self.policy = policy
        self.step = None if policy is DENSE else policy.graph_step(
            fwd, b, lambda layer, q, table, cu: self.attention(layer, q, cu))
        self.table = BlockTable(inp.ids, inp.offs, inp.masks)   # what a sparse step's kernels read
        # the torch model would memoise cos/sin by position tensor (frozen into a graph): made per replay
        self.rope_by_pos = fwd.model.rope_backend != "torch"
        self.out = torch.zeros(b, fwd.cfg.vocab_size, dtype=torch.float32, device=fwd.device)
        self.graph, self.graph_pool = None, graph_pool
        self.kernel_options = None  # set at capture

    def _body(self) -> None:
        fwd, inp, b, step = self.fwd, self.inp, self.b, self.step
        model, pool = fwd.model, fwd.pool
        inp.cu32.copy_(inp.cu)
        pos, w_block, w_slot = inp.pos[:b], inp.w_block[:b], inp.w_slot[:b]
        pool.slot_pos[w_block, w_slot] = pos.to(torch.int32)
        self.attention.prepare()
        h = model.embed(inp.tokens[:b])
        joined = False
        for layer in range(fwd.cfg.num_layers):
            rope = None
            if not self.rope_by_pos:
                cos, sin = rope_cos_sin(pos, model.inv_freq)
                rope = (cos[:, None, :], sin[:, None, :])
            q, _, _ = model.attention_inputs(layer, h, pos, rope=rope, write=pool.at(layer, w_block, w_slot))
            cu = inp.cu32[layer, :b + 1]
            if step is None:
                attn = self.attention(layer, q, cu)
            else:
                attn = step.attend(layer, q[:b], self.table, cu)
                if joined:     # RetroAttention's past rows, re-embedding: their attention here, after the current
                    attn = torch.cat([attn, step.attend_past(layer, self.table, cu)])
                past = step.join(layer, h[:b])
                if past is not None:
                    joined = True
                    h, attn = torch.cat([h, past.h]), torch.cat([attn, past.attn.to(attn.dtype)])
                    pos, w_block, w_slot = (torch.cat(pair) for pair in ((pos, past.pos), (w_block, past.block),
                                                                         (w_slot, past.slot)))
            h = model.finish_layer(layer, h, attn)
        self.out.copy_(model.logits(h[:b]))

    def run(self, seqs) -> torch.Tensor:
        """The step of ``seqs`` (loaded in ``inp`` already): logits, and what each sequence read in its stats."""
        if self.step is not None:
            self.step.load(seqs)
        if self.out.device.type != "cuda":
            self._body()
        else:
            if self.graph is not None and self.step is not None and self.step.stale():
                self.graph = None     # the step's buffers moved (RetroAttention's records grew): captured again
            if self.graph is None:
                self.graph = capture(self._body, self.graph_pool)   # the step's writes are idempotent
                self.kernel_options = current()  # what its launches were captured with (kernels/options.py)
                if self.step is not None:
                    self.step.captured()
            self.graph.replay()
        if self.step is not None:
            self.step.end()
        else:
            count_dense(self.fwd, seqs)
        return self.out


class DecodeGraphs:
    """DecodeGraphs by (batch bucket, entry capacity), least recently used dropped. ``buckets``,
    ``max_entries`` and ``num_splits`` (None: the kernel's pick for the first step of a bucket) may be
    set after construction (tests, benchmarks)."""

    def __init__(self, fwd):
        self.fwd = fwd
        self.host = HostTables()
        self.graphs: OrderedDict[tuple[int, int], DecodeGraph] = OrderedDict()
        self.inputs: dict[int, _Inputs] = {}
        self.graph_pool = torch.cuda.graph_pool_handle() if fwd.device.type == "cuda" else None
        self.buckets, self.max_entries, self.num_splits = BATCH_BUCKETS, MAX_ENTRIES, None
        self.enabled = True
        self.replays = 0

    def run(self, seqs, tokens, blocks, slots, positions) -> torch.Tensor | None:
        """Logits [n, vocab] of a step whose sequences already hold their new token (written at
        (blocks, slots) [n], positions [n]), or None when the step does not fit (run it eagerly)."""
        fwd, n = self.fwd, len(seqs)
        if not self.enabled or not 0 < n <= self.buckets[-1]:
            return None
        step = layout(seqs, tokens, blocks, slots, positions, self.host, fwd.cfg.num_layers, fwd.bs)
        if step.total > min(self.max_entries, MAX_ENTRIES):
            return None
        if step.tokens.min() < 0 or step.tokens.max() >= fwd.cfg.vocab_size:
            raise ValueError(f"a token id is outside the vocabulary [0, {fwd.cfg.vocab_size})")
        if step.offs.max() > MAX_OFFSET:  # what pack would refuse: the same clear error, found on the host
            check_encodable(fwd.bs, torch.from_numpy(step.ids), torch.from_numpy(step.offs))
        policy = seqs[0].decode
        if any(s.decode != policy for s in seqs[1:]):   # sequences of several policies: an eager step
            return None
        b = next(x for x in self.buckets if x >= n)
        cap = max(MIN_ENTRIES, 1 << (step.total - 1).bit_length())
        graph = self._graph(b, cap, step, policy)
        graph.inp.fill(step, b, fwd.scratch_block)
        try:
            out = graph.run(seqs)
        except Exception as exc:  # noqa: BLE001 - a step that cannot be captured runs eagerly from now on
            if graph.graph is not None or fwd.device.type != "cuda":
                raise
            log.warning("decode step capture failed (%s); decode steps run eagerly from now on", exc)
            self.enabled = False
            self.graphs.clear()
            return None
        self.replays += 1
        return out[:n].clone()  # the buffer is the next replay's: the caller gets its own

    def _graph(self, b: int, cap: int, step: StepLayout, policy) -> DecodeGraph:
        key = (b, cap, policy)
        graph = self.graphs.get(key)
        if graph is None:
            if len(self.graphs) >= MAX_GRAPHS:
                self.graphs.popitem(last=False)
                used = {c for _, c, _ in self.graphs}
                self.inputs = {c: i for c, i in self.inputs.items() if c in used}
            inp = self.inputs.get(cap) or self.inputs.setdefault(cap, _Inputs(self.fwd, cap))
            splits = self.num_splits
            if splits is None:
                # the backend's pick for this step's largest view, as if every padded row were as long
                per_view = int((step.cu[:, -1] - step.cu[:, 0]).max())
                splits = self.fwd.attention.decode_splits(b, self.fwd.cfg.num_kv_heads, per_view * b // step.n,
                                                          self.fwd.device)
            graph = self.graphs[key] = DecodeGraph(self.fwd, inp, b, splits or 1, self.graph_pool, policy)
        self.graphs.move_to_end(key)
        return graph
