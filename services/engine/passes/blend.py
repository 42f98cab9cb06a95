"""The blend step: reuse cached chunk KV and recompute only what cross-chunk attention changes.

Layout of one reuse request: chunks placed from position 0 in the given order, then the suffix.
  ratio 0   : only the suffix is computed; it attends to every chunk's cached KV (Block-Attention).
  ratio > 0 : layers before the check layer are computed for every token, each attending the fresh K/V
              of the tokens up to it (plain causal attention; layer 0 writes no chunk KV: its KV depends on
              the token alone, so the cache holds it); at the check layer the fresh K/V of every chunk token
              is compared with the cached copy and the top ``ratio`` of tokens by deviation (HKVD) are kept;
              from there on only they and the suffix are computed. Where it fits, the whole pass is one
              CUDA graph (blend_tail.py); this module is the general path.
Recomputed tokens get private slots at their global positions, and their shared twins are hidden by
the entries' slot masks: no shared block is copied or written (``copy=False``). ``copy=True`` is
CacheBlend as published: each chunk's KV is first copied and re-rotated to its global position and the
recomputed tokens overwrite their copies.
Causality is by global position in every kernel, so a recomputed token never sees a later token.

Host work is arranged so that the GPU never waits for it: everything the pass knows before it runs
(block tables, write slots, token ids; the number of recomputed tokens is round(ratio * n), so their
private blocks too) goes to the device in one copy (``RequestTables``), layer 0 over all tokens is
issued next, and what depends on the selection is built afterwards with a handful of device ops over
the whole request, never a per-chunk loop or a sync, while the GPU is still busy with layers 0..c.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from kernels.rope import rope_cos_sin, rotate
from services.engine.attention import self_causal
from services.engine.kv.block_table import BlockTable, chunk_rows, dense_run, host_to_device_many
from services.engine.request import PlacedChunk, Sequence

DEVIATION_METRICS = ("k", "v", "kv")


@dataclass(frozen=True, slots=True)
class BlendConfig:
    check_layer: int = 1
    deviation: str = "kv"   # which fresh-vs-cached difference ranks tokens: k (post-RoPE), v, or both

    def __post_init__(self) -> None:
        if self.check_layer < 0:
            raise ValueError(f"check_layer must be >= 0, got {self.check_layer}")
        if self.deviation not in DEVIATION_METRICS:
            raise ValueError(f"deviation must be one of {DEVIATION_METRICS}, got {self.deviation!r}")


def hkvd_scores(k_fresh, v_fresh, k_cached, v_cached, metric: str) -> torch.Tensor:
    """fp32 [N]: each token's squared L2 distance between fresh and cached K ("k"), V ("v") or both ("kv"),
    summed over heads. All tensors [N, Hkv, D]."""
    dev = torch.zeros(k_fresh.shape[0], dtype=torch.float32, device=k_fresh.device)
    if metric in ("k", "kv"):
        dev += (k_fresh.float() - k_cached.float()).pow(2).sum(dim=(1, 2))
    if metric in ("v", "kv"):
        dev += (v_fresh.float() - v_cached.float()).pow(2).sum(dim=(1, 2))
    return dev


def select_hkvd(k_fresh, v_fresh, k_cached, v_cached, n_keep: int, metric: str) -> torch.Tensor:
    """Indices (ascending) of the n_keep tokens whose fresh KV deviates most from the cache.

    All tensors [N, Hkv, D]; deviation as ``hkvd_scores``.
    """
    dev = hkvd_scores(k_fresh, v_fresh, k_cached, v_cached, metric)
    if n_keep >= dev.numel():
        return torch.arange(dev.numel(), device=dev.device)
    return torch.topk(dev, n_keep, sorted=False).indices.sort().values


class RequestTables:
    """Where every token of one reuse request reads and writes its KV, from one host-to-device copy.

    Entries, in this order: [extra | chunks | suffix]
      extra  : private blocks laid densely for ``n_extra`` tokens: the recomputed tokens (tessera with
               check layer 1), every chunk token (blend_copy's copies; tessera's layers 1..c-1 with a
               later check layer), or none (ratio 0);
      chunks : each placed chunk's shared blocks, offset = its rot, every slot of its tokens visible;
      suffix : the suffix's private blocks.
    ``w_block``/``w_slot`` [n_extra + n_suffix] are the extra tokens' then the suffix's private slots.
    Private blocks are allocated here and appended to ``private`` (the caller frees them on failure).
    """

    def __init__(self, fwd, placed: list[PlacedChunk], chunks, suffix, n_extra: int, private: list[int],
                 with_chunk_ids: bool):
        bs, dev, cache = fwd.bs, fwd.device, fwd.cache
        self.fwd, self.placed, self.bs = fwd, placed, bs
        lengths = [p.entry.length for p in placed]
        self.n_chunk, self.n_suffix, self.n_extra = sum(lengths), len(suffix), n_extra
        x_blocks = cache.allocate(-(-n_extra // bs), for_cache=False)
        private += x_blocks
        s_blocks = cache.allocate(-(-len(suffix) // bs), for_cache=False)
        private += s_blocks
        x = dense_run(x_blocks, n_extra, bs) if n_extra else None
        sfx = dense_run(s_blocks, len(suffix), bs)
        c_rows, rots, firsts = chunk_rows(placed, bs)
        n_x, n_c = len(x_blocks), c_rows.shape[1]
        # a chunk token's index in entry order (its entry = // BS, its slot = % BS) is its position plus this
        pad_before = [(n_x + f) * bs - p.start for p, f in zip(placed, firsts)]
        # entries [extra | chunks | suffix] as (block id, offset, mask) rows
        rows = np.empty((3, n_x + n_c + len(s_blocks)), dtype=np.int64)
        if x is not None:
            rows[:, :n_x] = x[:3]
        rows[:, n_x:n_x + n_c] = c_rows
        rows[:, n_x + n_c:] = sfx[:3]
        self.n_x_entries, self.n_c_entries = n_x, n_c
        n_s, n_all = len(suffix), self.n_chunk + len(suffix)
        # positions of every token that runs (all of them when chunk tokens run too), then the write slots:
        # with no extra tokens the suffix's (position, block, slot) rows lie together (``tokens``)
        pos = np.arange(0 if with_chunk_ids else self.n_chunk, n_all, dtype=np.int64)
        w_block, w_slot = (sfx[3], sfx[4]) if x is None else (np.concatenate([x[3], sfx[3]]), np.concatenate([x[4], sfx[4]]))
        ids_s, lanes, self.rows, self._per_chunk, s_flat, ids_offs, pos_s32 = host_to_device_many([
            np.asarray(suffix, dtype=np.int64), np.concatenate([pos, w_block, w_slot]), rows,
            np.array([pad_before, rots, lengths], dtype=np.int64),
            sfx[3] * bs + sfx[4], rows[:2].astype(np.int32), pos[-n_s:].astype(np.int32)], dev)
        n_pos, w = len(pos), n_extra + n_s
        self.pos, self.w_block, self.w_slot = lanes.split([n_pos, w, w])
        self.pos_s = self.pos[-n_s:]
        self.tokens = lanes[n_pos - n_s:].view(3, n_s) if n_extra == 0 else None  # pos_s, s_block, s_slot
        # chunk ids memoised on their entries: the token lists do not cross to the device again
        self.ids = torch.cat([fwd.chunk_ids(p.entry, c) for p, c in zip(placed, chunks)] + [ids_s]) \
            if with_chunk_ids else ids_s
        self.max_offset = max(rots + [0])
        self.ids_offs = ids_offs
        # the suffix's slots hold their global positions (read by every kernel's causal test)
        fwd.pool.slot_pos.view(-1).index_copy_(0, s_flat, pos_s32)
        self._chunk_tokens = None

    @property
    def s_block(self):
        return self.w_block[self.n_extra:]

    @property
    def s_slot(self):
        return self.w_slot[self.n_extra:]

    @property
    def x_block(self):
        return self.w_block[:self.n_extra]

    @property
    def x_slot(self):
        return self.w_slot[:self.n_extra]

    def table(self, start: int, stop: int, masks=None, visible: int | None = None) -> BlockTable:
        """Entries [start, stop) as a table (views of the request's rows), ``masks`` replacing theirs."""
        masks = self.rows[2, start:stop] if masks is None else masks[start:stop]
        return BlockTable(self.ids_offs[0, start:stop], self.ids_offs[1, start:stop], masks, self.max_offset,
                          self.n_chunk + self.n_suffix if visible is None else visible,
                          id_rows=self.rows[:2, start:stop])

    def shared_base(self) -> BlockTable:
        """Chunks then suffix: what layers before the check layer attend to (and every layer at ratio 0)."""
        return self.table(self.n_x_entries, self.rows.shape[1])

    def private_base(self) -> BlockTable:
        """Extra (every chunk token, private) then suffix: blend_copy's copies, or layers 1..c-1."""
        x, c = self.n_x_entries, self.n_c_entries
        rows = torch.cat([self.rows[:, :x], self.rows[:, x + c:]], dim=1)
        return BlockTable.from_rows(rows, 0, self.n_chunk + self.n_suffix)

    def set_extra_positions(self, pos: torch.Tensor) -> None:
        """The extra tokens' private slots hold global positions pos [n_extra]."""
        self.fwd.pool.slot_pos[self.x_block, self.x_slot] = pos.to(torch.int32)

    def chunk_tokens(self):
        """(flat slot [n_chunk] of each chunk token's cached KV in a layer's [N*BS] view, its index in
        entry order [n_chunk] (entry = // BS, slot = % BS), its rot [n_chunk]); built once per pass."""
        if self._chunk_tokens is None:
            # (a request of no chunks: no slots, and every per-token tensor below is empty)
            flat = torch.cat([self.fwd.chunk_slots(p.entry) for p in self.placed]
                             or [torch.zeros(0, dtype=torch.int64, device=self.fwd.device)])
            rep = torch.repeat_interleave(self._per_chunk[:2], self._per_chunk[2], dim=1, output_size=self.n_chunk)
            virtual = torch.arange(self.n_chunk, device=flat.device) + rep[0]
            cos, sin = rope_cos_sin(rep[1], self.fwd.model.inv_freq)
            self._chunk_tokens = (flat, virtual, rep[1], cos[:, None, :], sin[:, None, :])
        return self._chunk_tokens

    def cached_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached K (rotated to global positions, in the cache dtype) and V of every chunk token."""
        flat, _, _, cos, sin = self.chunk_tokens()
        pool = self.fwd.pool
        k = pool.k[layer].view(-1, *pool.k[layer].shape[2:])[flat]
        v = pool.v[layer].view(-1, *pool.v[layer].shape[2:])[flat]
        return rotate(k, cos, sin), v

    def hidden_masks(self, sel: torch.Tensor, extra_shows_selected: bool) -> torch.Tensor:
        """Every entry's mask with the selected chunk tokens sel [n] hidden in their shared entries, and,
        when ``extra_shows_selected`` (extra = every chunk token, densely), shown alone in the extra ones."""
        _, virtual, _, _, _ = self.chunk_tokens()
        bs = self.bs
        where = virtual[sel]
        idx, bit = where // bs, torch.bitwise_left_shift(1, where % bs)
        if extra_shows_selected:
            idx, bit = torch.cat([idx, sel // bs]), torch.cat([bit, torch.bitwise_left_shift(1, sel % bs)])
        # the bits of one entry are distinct, so their sum is their OR
        bits = torch.zeros(self.rows.shape[1], dtype=torch.int64, device=sel.device).index_add_(0, idx, bit)
        masks = self.rows[2] ^ bits  # hides: every hidden bit was set
        if extra_shows_selected:
            masks[:self.n_x_entries] = bits[:self.n_x_entries]
        return masks


def blend_pass(fwd, placed, chunks, pinned, private, suffix, mode, ratio, blend: BlendConfig, stats,
               keep_tables: bool = True):
    """Reuse pass over placed chunks (tessera, blend_copy, position_aware) -> (logits, Sequence).
    ``keep_tables`` False: the caller only releases the Sequence (a lean pass may then leave its tables out)."""
    copy = mode == "blend_copy"
    n_layers, c = fwd.cfg.num_layers, blend.check_layer
    t0 = time.perf_counter()
    n_chunk = sum(p.entry.length for p in placed)
    n_keep = int(round(ratio * n_chunk))
    # extra private tokens: blend_copy copies every chunk token; a later check layer computes every
    # chunk token in layers 1..c-1; otherwise only the recomputed ones (their count is known now)
    full_extra = copy or (ratio > 0.0 and c > 1)
    n_extra = n_chunk if full_extra else (n_keep if ratio > 0.0 else 0)
    rt = RequestTables(fwd, placed, chunks, suffix, n_extra, private, with_chunk_ids=ratio > 0.0)
    if copy:
        if fwd.gate is not None:
            fwd.gate.finish()  # the copy needs every layer before it starts
        # CacheBlend as published: copy every chunk's KV, keys re-rotated to the global position
        stats.copied_blocks = rt.n_x_entries
        rt.set_extra_positions(torch.arange(n_chunk, device=fwd.device))
        for layer in range(n_layers):
            k, v = rt.cached_kv(layer)
            fwd.pool.write(layer, rt.x_block, rt.x_slot, k, v)
        base = rt.private_base()
    else:
        base = rt.shared_base()

    if ratio == 0.0:
        tables = [base] * n_layers
        logits = fwd.run_layers(rt.ids, rt.pos_s, tables, rt.s_block, rt.s_slot, causal=False, tokens=rt.tokens)
    else:
        logits, tables = _blend_layers(fwd, rt, base, copy, full_extra, n_keep, blend, stats)
    stats.private_blocks_allocated += len(private)
    stats.forward_seconds = time.perf_counter() - t0
    tokens = {p.entry.key: c for p, c in zip(placed, chunks)}
    return logits, Sequence(tables, pinned, private, n_chunk + len(suffix), chunk_tokens=tokens)


def _blend_layers(fwd, rt: RequestTables, base, copy, full_extra, n_keep, blend, stats):
    n_layers, c, n_chunk = fwd.cfg.num_layers, blend.check_layer, rt.n_chunk
    # the big GPU work first: every token through layers 0..c-1, issued before any host work that
    # depends on it (the selection's tables are built while these layers run)
    h = fwd.model.embed(rt.ids)
    pos = rt.pos
    tables: list[BlockTable] = []
    pre_table = base
    if c > 1 and not copy:
        # layers 1..c-1 are computed in full: every chunk token has a private slot there (extra)
        rt.set_extra_positions(pos[:n_chunk])
        pre_table = rt.private_base()
    for layer in range(c):
        fwd.wait_layer(layer)
        q, k, v = fwd.model.attention_inputs(layer, h, pos)
        if layer == 0:
            table = base  # layer-0 KV depends on the token alone: the cache holds it exactly
            fwd.pool.write(layer, rt.s_block, rt.s_slot, k[n_chunk:], v[n_chunk:])
        else:
            table = pre_table
            fwd.pool.write(layer, rt.w_block, rt.w_slot, k, v)
        tables.append(table)
        fwd.tap(layer, q)
        # every token in order against its own keys, which the table holds (for layer 0, the cache holds the
        # same values): plain causal attention over the fresh K/V, nothing gathered
        h = fwd.model.finish_layer(layer, h, self_causal(q, k, v, fwd.model.scale))

    # check layer: rank chunk tokens by how far their fresh KV is from the cached KV
    fwd.wait_layer(c)
    q, k, v = fwd.model.attention_inputs(c, h, pos)
    if copy:
        k_cached, v_cached = fwd.pool.read(c, rt.x_block, rt.x_slot)
    else:
        k_cached, v_cached = rt.cached_kv(c)
    sel = select_hkvd(k[:n_chunk], v[:n_chunk], k_cached, v_cached, n_keep, blend.deviation)
    stats.tokens_recomputed = int(sel.numel())
    keep = torch.cat([sel, pos[n_chunk:]])  # chunk token t sits at position t: indices == positions
    if full_extra:
        # every chunk token has a private slot (blend_copy's copy, or layers 1..c-1): the kept ones write there
        post = base if copy else rt.table(0, rt.rows.shape[1], rt.hidden_masks(sel, extra_shows_selected=True))
        wb, ws = torch.cat([rt.x_block[sel], rt.s_block]), torch.cat([rt.x_slot[sel], rt.s_slot])
    else:
        post = rt.table(0, rt.rows.shape[1], rt.hidden_masks(sel, extra_shows_selected=False))
        rt.set_extra_positions(sel)
        wb, ws = rt.w_block, rt.w_slot  # the recomputed tokens' private slots, then the suffix's
    tables += [post] * (n_layers - c)
    if fwd.static_tail(keep.shape[0]):
        # the rest of the check layer (K/V write, attention, MLP) replays with the tail: the kept rows
        # are gathered straight into its buffers
        h = fwd.tails.run(c, h, keep, post, wb, ws, qkv=(q, k, v), rows=keep)
        return fwd.model.logits(h[-1:])[-1], tables
    h, pos, q, k, v = h[keep], keep, q[keep], k[keep], v[keep]
    fwd.pool.write(c, wb, ws, k, v)
    h = fwd.model.finish_layer(c, h, fwd.attend(c, q, pos, post, causal=False))
    h = fwd.tail(c + 1, h, pos, post, wb, ws, causal=False)
    return fwd.model.logits(h[-1:])[-1], tables
