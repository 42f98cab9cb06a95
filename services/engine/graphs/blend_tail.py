"""The CacheBlend pass (ratio > 0, check layer 1, no copy) as one host-to-device copy and one graph replay.

The general pass (blend.py) issues layer 0 over every token and the check layer's selection one op at a
time from the host, and only the layers after the selection replay as a graph: on an H100 the GPU waits
for the host for ~2-3 ms of a 22-ms pass (bench/engine/README.md). Everything that pass needs is
known on the host before it starts, except which tokens the check layer selects, and that is decided on
the device: so the whole pass is one graph. ``pack`` writes one pinned buffer laid out as the graph's
input (padding included), one asynchronous copy loads it, and the graph runs
  layer 0   : every token, attending its own fresh K/V causally (the flash path; a chunk token's
              layer-0 KV depends on the token alone, so the cache holds the same values); the
              suffix's K/V are written to its slots;
  layer 1   : q|k|v of every token; each chunk token's fresh K/V compared with its cached copy
              (keys rotated by the chunk's offset); the top n_keep by deviation selected (topk over a
              fixed bucket, the rows past n_keep marked padding, then sorted by position);
  the rest  : the selected rows' slot positions and the table's masks (their shared twins hidden)
              written in place, then StaticTail's layers 1..L-1 over [selected | suffix] rows, and the
              logits of the last suffix row. With the Triton backend those layers attend one key per
              position (``PositionalAttention``: gathered once a layer, then kernels/positional_attention),
              not the paged kernel over the table: on an H100 that call takes ~60 us a layer against ~170.
The number selected, round(ratio * chunk tokens), is known on the host, so the selected tokens' private
blocks are allocated before the pass, as the general path does.

Input buffer (int64; n head rows, k selected rows, s suffix rows, t = k + s tail rows, e entries):
    [ids n | position n | cached slot n | chunk offset n | entry index n | suffix head row s
     | tail position t | tail write block t | tail write slot t | entry block e | entry offset e | entry mask e
     | n_keep | last tail row]
Head rows: chunk tokens, suffix tokens, padding (position PAD_POS, cached slot -1). A chunk token's
cached slot is its slot in a layer's flat [N*BS] view, its entry index its slot in the table's entry
order (entry = // BS). Tail rows [0, k) are filled by the selection (host: their write slots; padding
past n_keep), rows [k, k + s) are the suffix's. Entries: [recomputed tokens' private | chunks | suffix |
padding (the scratch block, nothing shown)], the order of blend.RequestTables.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from kernels.paged_attention import MAX_OFFSET
from kernels.positional_attention import positional_attention
from kernels.rope import gather_rotate, rope_cos_sin
from services.engine.attention import self_causal
from services.engine.passes.blend import hkvd_scores
from services.engine.kv.block_table import BlockTable, chunk_rows, dense_run
from services.engine.graphs.tails import PAD_POS, T_BUCKET, KeyedTails, StaticTail, bucket, entry_bucket
from services.engine.request import Sequence
from services.engine.graphs.reuse_tail import StagedInputs

HEAD_BUCKET = 128  # head rows (every token of the request) padded to a multiple of this
# requests of more tokens run the general path: their layer 0 alone keeps the GPU busy long enough to hide
# the host, and a graph's buffers for them would hold as much memory as the activations of a long prefill
HEAD_MAX_TOKENS = 8192


def applies(fwd, placed, suffix, mode: str, ratio: float, check_layer: int) -> bool:
    """Whether a reuse pass (tessera, position_aware, blend_copy) takes this path (EngineOptions.blend_graph off:
    never; the general one, blend.blend_pass, runs it)."""
    if not fwd.options.blend_graph or ratio == 0.0 or mode == "blend_copy" or check_layer != 1:
        return False
    n_chunk = sum(p.entry.length for p in placed)
    n_keep = int(round(ratio * n_chunk))
    return (n_chunk + len(suffix) <= HEAD_MAX_TOKENS
            and fwd.static_tail(bucket(n_keep, T_BUCKET) + bucket(len(suffix), T_BUCKET)))


class PositionalAttention:
    """The blend tail's attention. After the selection every position has exactly one visible key: a
    recomputed token's fresh one in its private slot, any other chunk token's cached one (rotated by its
    chunk's offset), a suffix token's own. So each layer gathers them once, in position order
    (``gather_rotate`` over one-slot blocks), and each query attends the keys at positions up to its own
    (kernels/positional_attention): no table, no masks, no per-entry offsets in the attention loop.
    ``key_slot`` / ``key_rot`` [n + 1] are written by the graph's head; row n takes the padding's writes."""

    def __init__(self, fwd, t: int, n: int):
        dev = fwd.device
        self.fwd, self.n = fwd, n
        self.key_slot = torch.zeros(n + 1, dtype=torch.int64, device=dev)
        self.key_rot = torch.zeros(n + 1, dtype=torch.int64, device=dev)
        self.q_pos = torch.full((t,), -1, dtype=torch.int64, device=dev)
        self.backend = fwd.backend  # triton: the kernels; torch: their twins (SDPA with a mask)

    def prepare(self, pos: torch.Tensor) -> None:
        self.q_pos.copy_(torch.where(pos < PAD_POS, pos, -1))  # padded rows see no key

    def __call__(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        fwd, n = self.fwd, self.n
        kc, vc = fwd.pool.k[layer], fwd.pool.v[layer]
        k, v = gather_rotate(kc.view(-1, 1, *kc.shape[2:]), vc.view(-1, 1, *vc.shape[2:]), self.key_slot[:n],
                             self.key_rot[:n], fwd.model.inv_freq, backend=self.backend)
        return positional_attention(q, self.q_pos, k, v, fwd.model.scale, backend=self.backend)


class BlendTail(StaticTail):
    """The whole pass for one (n, k, s, e) bucket and deviation metric: the head (layer 0, the check
    layer's selection) in front of a StaticTail of layers 1..L-1 that starts at its K/V write."""

    def __init__(self, fwd, n: int, k: int, s: int, e: int, metric: str, graph_pool=None):
        # the Triton backend attends one key per position; the torch one keeps its SDPA over the padded table (its
        # twin of the positional kernel, SDPA with a mask over the gathered keys, measured slower on an H100:
        # bench/engine/README.md)
        positional = fwd.backend == "triton"
        super().__init__(fwd, 1, k + s, e, graph_pool, with_qkv=True,
                         attention=PositionalAttention(fwd, k + s, n) if positional else None)
        self.n, self.k, self.s, self.e, self.metric = n, k, s, e, metric
        t = k + s
        self.staging = StagedInputs(5 * n + s + 3 * t + 3 * e + 2, fwd.device)
        self.stage, self.load = self.staging.stage, self.staging.load
        x = self.inputs = self.staging.device_buffer
        head = x[:5 * n].view(5, n)
        self.ids, self.pos, self.cached_slot, self.chunk_offset, self.entry_index = head
        at = 5 * n
        self.s_rows = x[at:at + s]
        at += s
        self.tokens = x[at:at + 3 * t].view(3, t)
        at += 3 * t
        self.entries = x[at:at + 3 * e].view(3, e)
        at += 3 * e
        self.n_keep, self.last = x[at:at + 1], x[at + 1:at + 2]
        self.masks = torch.zeros(e, dtype=torch.int64, device=fwd.device)  # after the selection (the tables)
        if not positional:  # the padded table's ids/offsets are views of the inputs, its masks those above
            self.attention.id_rows, self.attention.masks = self.entries[:2], self.masks
        self.rank = torch.arange(k, device=fwd.device)  # each selected row's rank by deviation
        self.logits = None

    def _body(self) -> None:
        fwd, k = self.fwd, self.k
        model, pool, bs = fwd.model, fwd.pool, fwd.pool.block_size
        pos = self.pos
        h = model.embed(self.ids)
        rope = None
        if not self.rope_by_pos:
            cos, sin = rope_cos_sin(pos, model.inv_freq)
            rope = (cos[:, None, :], sin[:, None, :])
        # layer 0: every token over its own fresh K/V; the suffix's K/V kept (pad rows write the scratch block)
        q, key, val = model.attention_inputs(0, h, None if rope else pos, rope=rope)
        s_block, s_slot = self.tokens[1, k:], self.tokens[2, k:]
        pool.write(0, s_block, s_slot, key.index_select(0, self.s_rows), val.index_select(0, self.s_rows))
        h = model.finish_layer(0, h, self_causal(q, key, val, model.scale))
        # check layer: rank chunk tokens by how far their fresh K/V are from the cached ones
        q, key, val = model.attention_inputs(1, h, None if rope else pos, rope=rope)
        is_chunk = self.cached_slot >= 0
        flat = self.cached_slot.clamp(min=0)
        # the cached K/V, keys rotated by their chunk's offset: the torch twin, the general path's arithmetic
        kc, vc = gather_rotate(pool.k[1].view(-1, 1, *pool.k[1].shape[2:]), pool.v[1].view(-1, 1, *pool.v[1].shape[2:]),
                               flat, self.chunk_offset, model.inv_freq)
        dev = hkvd_scores(key, val, kc, vc, self.metric)
        dev = torch.where(is_chunk, dev, float("-inf"))
        top = torch.topk(dev, k, sorted=True).indices  # by deviation, largest first
        sel = torch.where(self.rank < self.n_keep, top, PAD_POS).sort().values  # positions; padding last
        real = sel < PAD_POS
        row = torch.where(real, sel, 0)  # a chunk token's head row is its position
        self.tokens[0, :k] = sel
        # the selected tokens' shared twins hidden: the bits of one entry are distinct, so their sum is their OR
        where = self.entry_index.index_select(0, row)
        bit = torch.where(real, torch.bitwise_left_shift(1, where % bs), 0)
        bits = torch.zeros(self.e, dtype=torch.int64, device=sel.device).index_add_(0, where // bs, bit)
        self.masks.copy_(self.entries[2] ^ bits)
        tpos, tblock, tslot = self.tokens
        pool.slot_pos[tblock, tslot] = torch.where(tpos < PAD_POS, tpos, 0).to(torch.int32)
        att, n = self.attention, self.n
        if isinstance(att, PositionalAttention):
            # one key per position: the cached ones (chunk offsets), then the recomputed tokens' and the suffix's
            # private slots over theirs (keys at global positions); padding writes row n
            att.key_slot[:n].copy_(flat)
            att.key_rot[:n].copy_(self.chunk_offset)
            private = tblock * bs + tslot
            att.key_slot.index_copy_(0, torch.where(real, sel, n), private[:k])
            att.key_rot.index_fill_(0, torch.where(real, sel, n), 0)
            att.key_slot.index_copy_(0, torch.where(tpos[k:] < PAD_POS, self.s_rows, n), private[k:])
        rows = torch.cat([row, self.s_rows])
        torch.index_select(h, 0, rows, out=self.h)
        for src, buf in zip((q, key, val), self.qkv):
            torch.index_select(src, 0, rows, out=buf)
        super()._body()
        self.logits = model.logits(self.out.index_select(0, self.last))[0]

    def run(self) -> torch.Tensor:
        """The next-token logits [vocab] (a buffer of the graph: the caller copies what it keeps)."""
        super().run()
        return self.logits

    def tables(self, n_x: int, m: int, max_offset: int, visible: int, n_layers: int) -> list[BlockTable]:
        """The pass's per-layer tables as the request's own device copies: layer 0 the shared base (chunks
        and suffix), the others every entry with the selected twins hidden (after the replay)."""
        rows = torch.cat([self.entries[:, :m], self.masks[None, :m]])  # ids, offsets, masks, masks after
        ids_offs = rows[:2].to(torch.int32)
        base = BlockTable(ids_offs[0, n_x:], ids_offs[1, n_x:], rows[2, n_x:], max_offset, visible, rows[:2, n_x:])
        post = BlockTable(ids_offs[0], ids_offs[1], rows[3], max_offset, visible, rows[:2])
        return [base] + [post] * (n_layers - 1)


def blend_tails(fwd) -> KeyedTails:
    """BlendTail by (head, selected, suffix, entry bucket, deviation metric)."""
    return KeyedTails(lambda n, k, s, e, metric: BlendTail(fwd, n, k, s, e, metric, fwd.tails.graph_pool))


def pack(buf: np.ndarray, placed, chunk_ids: list[np.ndarray], chunk_slots: list[np.ndarray], suffix: list[int],
         x_blocks: list[int], s_blocks: list[int], n_keep: int, bs: int, scratch: int, n: int, k: int, s: int, e: int):
    """Write the BlendTail inputs (layout above) into ``buf`` -> (recomputed entries n_x, real entries m, the
    largest offset, the chunks' token count). ``chunk_ids`` / ``chunk_slots``: each placed chunk's token ids and
    slots in a layer's flat view (int64, Forward.host_chunk_ids / host_chunk_slots)."""
    t = k + s
    lengths = [p.entry.length for p in placed]
    n_chunk, n_s = sum(lengths), len(suffix)
    n_all = n_chunk + n_s
    c_rows, rots, firsts = chunk_rows(placed, bs)
    xb = dense_run(x_blocks, n_keep, bs)
    sb = dense_run(s_blocks, n_s, bs)
    n_x, n_c = len(x_blocks), c_rows.shape[1]
    m = n_x + n_c + len(s_blocks)
    ids, pos, cached_slot, chunk_offset, entry_index = buf[:5 * n].reshape(5, n)
    ids[:n_chunk] = np.concatenate(chunk_ids) if chunk_ids else []
    ids[n_chunk:n_all] = suffix
    ids[n_all:] = 0
    pos[:n_all] = np.arange(n_all)
    pos[n_all:] = PAD_POS
    cached_slot[:n_chunk] = np.concatenate(chunk_slots) if chunk_slots else []
    cached_slot[n_chunk:] = -1
    chunk_offset[:n_chunk] = np.repeat(np.asarray(rots, dtype=np.int64), lengths)
    chunk_offset[n_chunk:] = 0
    # a chunk token's slot in entry order is its position plus its chunk's pad_before
    pad_before = [(n_x + f) * bs - p.start for p, f in zip(placed, firsts)]
    entry_index[:n_chunk] = np.arange(n_chunk) + np.repeat(np.asarray(pad_before, dtype=np.int64), lengths)
    entry_index[n_chunk:] = 0
    at = 5 * n
    s_rows = buf[at:at + s]
    s_rows[:n_s] = np.arange(n_chunk, n_all)
    s_rows[n_s:] = 0  # padded suffix rows read head row 0; their K/V go to the scratch block
    at += s
    tpos, tblock, tslot = buf[at:at + 3 * t].reshape(3, t)
    tpos[:] = PAD_POS  # the first n_keep are the selection's, written by the graph
    tpos[k:k + n_s] = np.arange(n_chunk, n_all)
    tblock[:] = scratch
    tblock[:n_keep] = xb[3]
    tblock[k:k + n_s] = sb[3]
    tslot[:] = np.arange(t) % bs  # padded rows' scratch slots, as StaticTail's
    tslot[:n_keep] = xb[4]
    tslot[k:k + n_s] = sb[4]
    at += 3 * t
    e_ids, e_offs, e_masks = buf[at:at + 3 * e].reshape(3, e)
    e_ids[:n_x], e_offs[:n_x], e_masks[:n_x] = xb[:3]
    e_ids[n_x:n_x + n_c], e_offs[n_x:n_x + n_c], e_masks[n_x:n_x + n_c] = c_rows
    e_ids[n_x + n_c:m], e_offs[n_x + n_c:m], e_masks[n_x + n_c:m] = sb[:3]
    e_ids[m:], e_offs[m:], e_masks[m:] = scratch, 0, 0
    at += 3 * e
    buf[at], buf[at + 1] = n_keep, k + n_s - 1
    return n_x, m, max(rots, default=0), n_chunk


def blend_tail_pass(fwd, placed, chunks, pinned, private, suffix, ratio: float, metric: str, stats,
                    keep_tables: bool = True):
    """blend.blend_pass at ratio > 0 with check layer 1 and no copy, where ``applies`` -> (logits, Sequence).
    ``keep_tables``: the Sequence gets its per-layer tables (decode, hand-off); else none."""
    t0 = time.perf_counter()
    bs, n_s = fwd.bs, len(suffix)
    n_chunk = sum(p.entry.length for p in placed)
    n_keep = int(round(ratio * n_chunk))
    x_blocks = fwd.cache.allocate(-(-n_keep // bs), for_cache=False)
    private += x_blocks
    s_blocks = fwd.cache.allocate(-(-n_s // bs), for_cache=False)
    private += s_blocks
    n_entries = len(x_blocks) + sum(len(p.entry.blocks) for p in placed) + len(s_blocks)
    n, k, s = bucket(n_chunk + n_s, HEAD_BUCKET), bucket(n_keep, T_BUCKET), bucket(n_s, T_BUCKET)
    e = entry_bucket(n_entries, bs)
    if fwd.blend_tails is None:
        fwd.blend_tails = blend_tails(fwd)
    tail = fwd.blend_tails.get(n, k, s, e, metric)
    ids = [fwd.host_chunk_ids(p.entry, c) for p, c in zip(placed, chunks)]
    slots = [fwd.host_chunk_slots(p.entry) for p in placed]
    n_x, m, max_offset, _ = pack(tail.stage(), placed, ids, slots, suffix, x_blocks, s_blocks, n_keep, bs,
                                 fwd.scratch_block, n, k, s, e)
    if max_offset > MAX_OFFSET:  # the engine's input check refuses such requests first
        raise ValueError(f"position offset {max_offset} does not fit the kernels' offset field (0..{MAX_OFFSET})")
    tail.load()
    fwd.blend_tails.replays += 1
    logits = tail.run().clone()
    visible = n_chunk + n_s
    tables = tail.tables(n_x, m, max_offset, visible, fwd.cfg.num_layers) if keep_tables else []
    stats.tokens_recomputed = n_keep
    stats.private_blocks_allocated += len(private)
    stats.forward_seconds = time.perf_counter() - t0
    tokens = {p.entry.key: c for p, c in zip(placed, chunks)}
    return logits, Sequence(tables, pinned, private, visible, chunk_tokens=tokens)
