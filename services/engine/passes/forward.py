"""Layer-by-layer passes over the paged KV: chunk computation, every prefill mode, batched decode.

Every pass is the same loop: at each layer the *active* tokens (those whose hidden state is computed)
produce q/k/v, the tokens that own private slots write their k/v (in the q|k|v kernel itself where every
active token writes), and the active queries attend to the layer's block table. Modes differ only in
which tokens are active and which entries each layer sees.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np
import torch

from services.engine.attention import BACKENDS
from services.engine.decode.policy import PolicyStep
from services.engine.graphs import blend_tail, reuse_tail
from services.engine.passes.blend import BlendConfig, blend_pass
from services.engine.kv.block_table import BlockTable, dense_run, host_to_device
from services.engine.kv.chunk_cache import ChunkEntry, chunk_id
from services.engine.model.config import ModelConfig
from services.engine.graphs.tails import STATIC_MAX_TOKENS, TailCache
from services.engine.kv.loader import ChunkLoad, LayerGate, as_layers
from services.engine.model.layers import Transformer
from services.engine.options import EngineOptions
from services.engine.request import PlacedChunk, PrefillStats, Sequence


SETTLE_S = 0.01  # how long a pass waits for its chunk loads to finish before it goes on layer by layer


def reuse_path(fwd: "Forward", placed, suffix, mode: str, ratio: float, check_layer: int) -> str:
    """The one place a reuse pass (tessera, position_aware, blend_copy) is routed:
      "blend_graph"  ratio > 0 and the whole pass fits one graph (graphs/blend_tail.py; EngineOptions.blend_graph);
      "reuse_graph"  ratio 0, not blend_copy, the suffix fits a static tail: one pinned copy and one replay
                     (graphs/reuse_tail.py; EngineOptions.reuse_graph);
      "general"      passes/blend.py, layer by layer; its remaining layers replay as a static tail where they fit
                     (``Forward.tail``, graphs/tails.py), else run eagerly.
    Plain causal passes (``full``, a chunk computed alone) never come here: they take ``Forward.tail`` directly."""
    if blend_tail.applies(fwd, placed, suffix, mode, ratio, check_layer):
        return "blend_graph"
    if ratio == 0.0 and mode != "blend_copy" and fwd.options.reuse_graph and fwd.static_tail(len(suffix)):
        return "reuse_graph"
    return "general"


class Forward:
    def __init__(self, cfg: ModelConfig, weights, backend: str, static_tails: bool = False,
                 options: EngineOptions | None = None):
        self.cfg = cfg
        self.static_tails = static_tails
        self.options = EngineOptions() if options is None else options
        self.model = Transformer(cfg, weights, rope_backend=backend, skinny_gemm=self.options.skinny_gemm)
        self.backend = backend

    def bind(self, pool, cache, block_size: int, fingerprint: str) -> None:
        self.pool, self.cache, self.bs = pool, cache, block_size
        self.device = pool.slot_pos.device
        self._fingerprint = fingerprint
        self.attention = BACKENDS[self.backend](pool, self.model.inv_freq, self.model.scale)
        self.gate: LayerGate | None = None  # set while a pass waits on layer-streamed chunk loads
        # static tails replay short passes as CUDA graphs, attention through either backend (see graphs.py)
        self.scratch_block = pool.reserve()
        self.tails = TailCache(self) if self.static_tails else None
        self.id_tails = None  # ratio-0 reuse passes' tails, made on first use (reuse_tail.py)
        self.blend_tails = None  # ratio > 0 reuse passes' whole-pass graphs, likewise (blend_tail.py)
        self.decode_graphs = None  # decode steps' graphs per batch bucket, likewise (graphs/decode.py)
        self.layer_graphs = None  # graphs between a step's attentions, when they wait for the host (graphs/layers.py)
        self.retro_records: dict = {}  # RetroAttention's windows on the device by shape (decode/retro.py RetroRecords)
        # while a request's own pass runs for a retrieval decode: its queries are kept (decode/retrieval.py QueryTap)
        self.query_tap = None
        self.indexes = None  # offloaded K/V and their indexes (services/index/heads.py IndexSet), made on first use
        self.index_builder = None  # the thread building them (decode/retrieval.py), likewise
        self.index_copier = None  # the thread copying a retrieval sequence's K/V to the host for them, likewise
        self.chunk_indexes = None  # built chunk indexes by chunk id (services/index/chunks.py ChunkIndexCache), likewise
        self.chunk_builds: dict = {}  # chunk id -> Future of its index while it builds
        self.chunk_index_store = None  # where chunk indexes are kept beside the chunks' KV (get / put by chunk id)
        self.chunk_index_refused = 0  # stored chunk indexes refused (damaged or another shape), built again
        self._chunk_tables: OrderedDict[tuple, BlockTable] = OrderedDict()  # see chunk_table

    def static_tail(self, n_tokens: int) -> bool:
        """Whether a pass of n_tokens active tokens replays its remaining layers as a static tail."""
        return (self.tails is not None and n_tokens <= STATIC_MAX_TOKENS and self.query_tap is None
                and self._settled())

    def tail(self, first: int, h, pos, table: BlockTable, w_block, w_slot, causal: bool | None = None,
              tokens: torch.Tensor | None = None):
        """Layers [first, L) for active tokens that all attend ``table``; returns h after the last layer
        (``causal`` as in attend; ``tokens`` as in run_layers)."""
        if self.static_tail(h.shape[0]):
            return self.tails.run(first, h, pos, table, w_block, w_slot, tokens=tokens)
        for layer in range(first, self.cfg.num_layers):
            self.wait_layer(layer)
            q, _, _ = self.model.attention_inputs(layer, h, pos, write=self.pool.at(layer, w_block, w_slot))
            h = self.model.finish_layer(layer, h, self.attend(layer, q, pos, table, causal))
        return h

    def wait_layer(self, layer: int) -> None:
        if self.gate is not None:
            self.gate.wait(layer)

    def _settled(self) -> bool:
        """No chunk is still streaming in: none was, or every load has delivered (loads from a worker's
        host memory are waited for, up to loader.LOCAL_SETTLE_S; store streams up to ``SETTLE_S``). The
        pass then stops waiting layer by layer and may replay its remaining layers as one graph; a
        slower stream keeps the layer-by-layer pipeline, which overlaps its arrival with the compute."""
        if self.gate is None:
            return True
        if not self.gate.settled(SETTLE_S):
            return False
        self.gate.finish()
        return True

    # ------------------------------------------------------------------ primitives
    def attend(self, layer: int, q, q_pos, table: BlockTable, causal: bool | None = None):
        """``causal``: True when the caller knows that the table's visible keys, in entry order, are exactly
        the queries' positions (plain causal attention), False when they are not, None to have it checked."""
        self.tap(layer, q)
        return self.attention.prefill(layer, q, q_pos, table, causal=causal)

    def tap(self, layer: int, q) -> None:
        """A pass's queries at ``layer`` [T, Hq, D] (rotated at global positions), to the query tap if one is set."""
        if self.query_tap is not None:
            self.query_tap(layer, q)

    def chunk_ids(self, entry: ChunkEntry, tokens: list[int]) -> torch.Tensor:
        """The chunk's token ids on the device, int64 [length], memoised on the entry (named by them)."""
        if entry.ids is None:
            entry.ids = host_to_device(self.host_chunk_ids(entry, tokens), torch.long, self.device)
        return entry.ids

    def host_chunk_ids(self, entry: ChunkEntry, tokens: list[int]) -> np.ndarray:
        """The chunk's token ids on the host, int64 [length], memoised on the entry (named by them)."""
        if entry.host_ids is None:
            entry.host_ids = np.asarray(tokens, dtype=np.int64)
        return entry.host_ids

    def chunk_slots(self, entry: ChunkEntry) -> torch.Tensor:
        """Index of each token's slot in a layer's flat [N*BS] KV view, int64 [length], memoised on the entry."""
        if entry.slots is None:
            entry.slots = host_to_device(self.host_chunk_slots(entry), torch.long, self.device)
        return entry.slots

    def host_chunk_slots(self, entry: ChunkEntry) -> np.ndarray:
        """``chunk_slots`` on the host, int64 [length], memoised on the entry (its blocks never change while it is
        cached)."""
        if entry.host_slots is None:
            blocks = np.asarray(entry.blocks, dtype=np.int64)
            idx = np.arange(entry.length, dtype=np.int64)
            entry.host_slots = blocks[idx // self.bs] * self.bs + idx % self.bs
        return entry.host_slots

    def chunk_table(self, blocks: list[int], n_tokens: int, offset: int) -> BlockTable:
        """The table of a cached chunk's run at ``offset`` with nothing hidden, memoised: building one
        copies its block ids and masks from the host, and each such copy waits for the GPU."""
        key = (tuple(blocks), n_tokens, offset)
        table = self._chunk_tables.get(key)
        if table is None:
            if len(self._chunk_tables) >= 512:
                self._chunk_tables.popitem(last=False)
            table = self._chunk_tables[key] = BlockTable.for_run(blocks, n_tokens, self.bs, offset, self.device)
        self._chunk_tables.move_to_end(key)
        return table

    def _private(self, pos: torch.Tensor, for_cache: bool = False, contiguous: bool = False):
        """Slots for tokens at global positions ``pos`` [n], laid densely over new blocks (consecutive
        ones where a run is free, with ``contiguous``).

        Returns (blocks, block [n], slot [n], table with offset 0)."""
        n = int(pos.numel())
        blocks = self.cache.allocate(-(-n // self.bs), for_cache=for_cache, contiguous=contiguous)
        table, block, slot = self._dense_table(blocks, n)
        self.pool.slot_pos[block, slot] = pos.to(torch.int32)
        return blocks, block, slot, table

    def _dense_table(self, blocks: list[int], n: int):
        """(table, block [n], slot [n]) of n tokens laid densely over ``blocks``: one host-to-device copy."""
        ids, offs, masks, block, slot = dense_run(blocks, n, self.bs)
        e = len(ids)
        flat = host_to_device(np.concatenate([ids, offs, masks, block, slot]), torch.int64, self.device)
        return BlockTable.from_rows(flat[:3 * e].view(3, e), 0, n), flat[3 * e:3 * e + n], flat[3 * e + n:]

    def run_layers(self, ids: torch.Tensor, pos: torch.Tensor, tables, write_block, write_slot, last_only=True,
             skip_last_layer=False, causal: bool | None = None, tokens: torch.Tensor | None = None):
        """Plain pass: every token active at every layer, all of them written to their slots. ``tokens``:
        pos, write_block and write_slot as the rows of one [3, n] tensor, when the caller has them so."""
        h = self.model.embed(ids)
        n_layers = self.cfg.num_layers
        if not skip_last_layer and all(t is tables[0] for t in tables):
            h = self.tail(0, h, pos, tables[0], write_block, write_slot, causal, tokens)
            return self.model.logits(h[-1:] if last_only else h)[-1]
        for layer in range(n_layers):
            self.wait_layer(layer)
            q, _, _ = self.model.attention_inputs(layer, h, pos, write=self.pool.at(layer, write_block, write_slot))
            if skip_last_layer and layer == n_layers - 1:
                return None
            h = self.model.finish_layer(layer, h, self.attend(layer, q, pos, tables[layer], causal))
        return self.model.logits(h[-1:] if last_only else h)[-1]

    def compute_chunk(self, key: str, tokens: list[int], base: int = 0, kind: str = "chunk"):
        """Compute a chunk alone at positions base..base+L-1 and cache it under ``key`` (pinned)."""
        blocks = self.cache.allocate(-(-len(tokens) // self.bs), for_cache=True)
        try:
            self._compute_into(blocks, tokens, base)  # keys rotated at base..base+L-1
        except BaseException:
            self.pool.free(blocks)
            raise
        return self.cache.insert(key, blocks, len(tokens), base=base, kind=kind)

    def tap_chunk(self, tokens: list[int], tap) -> None:
        """Run a chunk alone at positions 0..L-1 with ``tap`` taking its queries (in its own frame); the KV it writes
        goes to scratch blocks, freed after."""
        blocks = self.cache.allocate(-(-len(tokens) // self.bs), for_cache=False)
        try:
            self._compute_into(blocks, tokens, 0, tap)
        finally:
            self.pool.free(blocks)

    def _compute_into(self, blocks: list[int], tokens: list[int], base: int, chunk_tap=None) -> None:
        pos = torch.arange(base, base + len(tokens), device=self.device)
        table, block, slot = self._dense_table(blocks, len(tokens))
        self.pool.slot_pos[block, slot] = pos.to(torch.int32)
        ids = host_to_device(tokens, torch.long, self.device)
        gate, self.gate = self.gate, None  # a chunk computed alone waits on nothing
        # and its queries, in its own frame, are not the request's (``chunk_tap``: taken for the chunk's own index)
        tap, self.query_tap = self.query_tap, chunk_tap
        try:
            if self.tails is not None and len(tokens) <= STATIC_MAX_TOKENS and chunk_tap is None:
                # replayed as a CUDA graph: every layer, the last one's output unused (one layer of
                # wasted work against ~1,000 eager launches)
                self.tail(0, self.model.embed(ids), pos, table, block, slot)
            else:   # a tapped pass attends at the last layer too: that layer's queries are wanted
                self.run_layers(ids, pos, [table] * self.cfg.num_layers, block, slot,
                                skip_last_layer=chunk_tap is None, causal=True)
        finally:
            self.gate, self.query_tap = gate, tap

    def insert_chunk(self, key: str, tokens_or_length, layers) -> ChunkEntry:
        """Write a chunk's KV, a stream of ``StreamedLayer`` (k, v [L, Hkv, D], keys at local positions); pinned."""
        n = tokens_or_length if isinstance(tokens_or_length, int) else len(tokens_or_length)
        blocks, block, slot, _ = self._private(torch.arange(n, device=self.device), for_cache=True, contiguous=True)
        write = self._chunk_writer(key, n, blocks, block, slot)
        try:
            items = list(as_layers(layers))
            if len(items) != self.cfg.num_layers:
                raise ValueError(f"chunk {key[:12]} came with {len(items)} layers, the model has {self.cfg.num_layers}")
            write.many(items)   # every layer in one batched copy when the blocks are a run
        except BaseException:
            self.pool.free(blocks)
            raise
        return self.cache.insert(key, blocks, n, base=0, kind="chunk")

    def export_chunk(self, entry) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A resident chunk's KV per layer, (k, v) each [L, Hkv, D] (copies)."""
        block, slot = self.pool.slots_for(entry.blocks, entry.length)
        return [tuple(t.clone() for t in self.pool.read(layer, block, slot)) for layer in range(self.cfg.num_layers)]

    # ------------------------------------------------------------------ prefill
    def prefill(self, chunks, suffix, mode: str, ratio: float, blend: BlendConfig, stats: PrefillStats,
                fetch=None, on_computed=None, ids: list[str] | None = None, keep_tables: bool = True,
                scope: str = ""):
        """``ids``: the chunks' ids (chunk_id of each, as Engine._validate computed them), or None.
        ``keep_tables`` False: the caller only releases the Sequence (see blend_pass). ``scope``: the request's
        chunk namespaces, hashed into prefix caching's keys (tenants never share a prefix)."""
        if mode in ("full", "prefix"):
            return self._prefill_dense(chunks, suffix, mode, stats, scope)
        try:
            return self._prefill_reuse(chunks, suffix, mode, ratio, blend, stats, fetch, on_computed, ids, keep_tables)
        finally:
            gate, self.gate = self.gate, None
            if gate is not None:
                gate.finish()
                stats.load_wait_seconds = gate.wait_seconds
                stats.load_failures = gate.failed
                stats.loaded_bytes = sum(load.bytes for load in gate.loads)
                stats.load_seconds = max(load.seconds for load in gate.loads)

    def _prefill_dense(self, chunks, suffix, mode, stats, scope: str = ""):
        """full: every token computed, nothing cached. prefix: reuse the longest cached chunk prefix,
        compute the rest in context and cache each new chunk under the hash of its whole prefix."""
        pinned, tables, start = [], [], 0
        keys, h_prefix = [], None
        if mode == "prefix":
            for c in chunks:
                # a chain hash: chunk i is named by everything before it (namespaced apart from chunk ids)
                h_prefix = chunk_id(h_prefix or f"prefix:{self._fingerprint}" + (f":{scope}" if scope else ""), c)
                keys.append(h_prefix)
        n_hit = 0
        if mode == "prefix":
            for i, c in enumerate(chunks):
                entry = self.cache.acquire(keys[i])
                if entry is None:
                    break
                pinned.append(entry)
                tables.append(self.chunk_table(entry.blocks, entry.length, 0))
                start += entry.length
                n_hit += 1
        stats.chunk_hits, stats.chunk_misses = n_hit, len(chunks) - n_hit
        runs, private = [], []
        try:
            return self._dense_pass(chunks, suffix, mode, stats, keys, pinned, tables, start, n_hit, runs, private)
        except BaseException:   # (e.g. the pool short of blocks for the suffix): nothing of the request is kept
            cached = {b for entry in pinned for b in entry.blocks}
            for entry in pinned:
                self.cache.release(entry)
            self.pool.free(sorted(set(private) | {b for r in runs for b in r[2] if b not in cached}))
            raise

    def _dense_pass(self, chunks, suffix, mode, stats, keys, pinned, tables, start, n_hit, runs, private):
        """``_prefill_dense`` once its cached prefix is found: ``runs`` and ``private`` list the blocks it takes as
        it takes them (the caller frees them if it fails)."""
        dev = self.device
        t0 = time.perf_counter()
        # new chunks each get their own blocks (cacheable in prefix mode); the suffix gets private ones
        for i, c in enumerate(chunks[n_hit:], start=n_hit):
            pos = torch.arange(start, start + len(c), device=dev)
            blocks, block, slot, table = self._private(pos, for_cache=(mode == "prefix"))
            runs.append((keys[i] if mode == "prefix" else None, c, blocks, block, slot, start))
            tables.append(table)
            start += len(c)
            stats.chunk_tokens_computed += len(c)
            if mode == "prefix":
                stats.shared_blocks_allocated += len(blocks)
            else:
                private += blocks
                stats.private_blocks_allocated += len(blocks)
        pos_s = torch.arange(start, start + len(suffix), device=dev)
        s_blocks, s_block, s_slot, s_table = self._private(pos_s)
        private += s_blocks
        stats.private_blocks_allocated += len(s_blocks)
        tables.append(s_table)
        table = BlockTable.cat(tables)
        ids = host_to_device([t for r in runs for t in r[1]] + suffix, torch.long, dev)
        pos = torch.arange(start - sum(len(r[1]) for r in runs), start + len(suffix), device=dev)
        wb = torch.cat([r[3] for r in runs] + [s_block])
        ws = torch.cat([r[4] for r in runs] + [s_slot])
        # with no cached prefix the keys are the queries, in order
        logits = self.run_layers(ids, pos, [table] * self.cfg.num_layers, wb, ws, causal=n_hit == 0)
        for key, c, blocks, _, _, base in runs:
            if key is None:
                continue
            if key in self.cache:  # computed concurrently by an equal prefix: keep ours private
                private += blocks
            else:
                pinned.append(self.cache.insert(key, blocks, len(c), base=0, kind="prefix"))
        stats.forward_seconds = time.perf_counter() - t0
        return logits, Sequence([table] * self.cfg.num_layers, pinned, private, start + len(suffix))

    def _place(self, chunks, mode, stats, fetch=None, on_computed=None, ids=None) -> list[PlacedChunk]:
        """Find every chunk in the device cache, else stream it from the store (``fetch``), else compute
        it alone: position-agnostic (tessera, blend_copy) or one replica per position (position_aware)."""
        placed, start, loads = [], 0, []
        t0 = time.perf_counter()
        try:
            for i, c in enumerate(chunks):
                cid = ids[i] if ids is not None else chunk_id(self._fingerprint, c)
                aware = mode == "position_aware"
                key = f"{cid}@{start}" if aware else cid
                entry = self.cache.acquire(key)
                layers = None if entry is not None or aware or fetch is None else fetch(cid)
                if entry is not None:
                    stats.chunk_hits += 1
                elif layers is not None:
                    entry = self._start_load(key, c, layers, loads)
                    stats.store_hits += 1
                    stats.shared_blocks_allocated += len(entry.blocks)
                else:
                    entry = self.compute_chunk(key, c, base=start if aware else 0, kind="position" if aware else "chunk")
                    stats.chunk_misses += 1
                    stats.chunk_tokens_computed += len(c)
                    stats.shared_blocks_allocated += len(entry.blocks)
                    if on_computed is not None and not aware:
                        on_computed(cid, self.export_chunk(entry))
                placed.append(PlacedChunk(entry, start))
                start += len(c)
        except BaseException:
            for p in placed:
                self.cache.release(p.entry)
            for load in loads:  # a half-loaded chunk must never be served later
                load.join()
                self.cache.discard(load.entry)
            raise
        stats.chunk_compute_seconds = time.perf_counter() - t0
        if loads:
            self.gate = LayerGate(loads, self._recompute_load)
        return placed

    def _chunk_writer(self, key: str, n: int, blocks: list[int], block: torch.Tensor, slot: torch.Tensor):
        """write(layer, k, v) of a chunk's n tokens laid densely over ``blocks``: shapes checked, then two
        plain copies when the blocks are consecutive (from pinned host memory: host-to-device straight
        into the pool, no staging tensor, no kernel), else through the indexed write. ``write.many(items)``
        writes every layer's [(layer, k, v), ...] at once (one batched copy over a run)."""
        shape = (n, self.cfg.num_kv_heads, self.cfg.head_dim)
        run = self.pool.run(blocks)

        def check(layer, k, v):
            if tuple(k.shape) != shape or tuple(v.shape) != shape:
                raise ValueError(f"layer {layer} of chunk {key[:12]} has shapes {tuple(k.shape)}/{tuple(v.shape)}, "
                                 f"expected {shape}")

        def write(layer, k, v):
            check(layer, k, v)
            if run is not None:
                self.pool.write_run(layer, run, k, v)
            else:
                self.pool.write(layer, block, slot, k.to(self.device, non_blocking=True),
                                v.to(self.device, non_blocking=True))

        def many(items):
            """Every layer at once: shapes checked first, then one batched copy over a run."""
            for layer, k, v in items:
                check(layer, k, v)
            if run is not None:
                self.pool.write_runs(run, items)
            else:
                for layer, k, v in items:
                    write(layer, k, v)

        write.many = many
        return write

    def _start_load(self, key: str, tokens: list[int], layers, loads: list) -> ChunkEntry:
        n = len(tokens)
        blocks, block, slot, _ = self._private(torch.arange(n, device=self.device), for_cache=True, contiguous=True)
        entry = self.cache.insert(key, blocks, n, base=0, kind="chunk")
        write = self._chunk_writer(key, n, blocks, block, slot)
        local = getattr(layers, "local", False)
        load = ChunkLoad(key, tokens, as_layers(layers), write, self.cfg.num_layers, local=local,
                         write_many=write.many if local else None, verify=getattr(layers, "verify", None))
        load.entry = entry
        loads.append(load)
        if load.write_many is not None:
            load.issue()       # from this process's memory: every copy queued now, on the load stream
        else:
            load.start()       # streamed: layer by layer, as the layers arrive
        return entry

    def _recompute_load(self, load: ChunkLoad) -> None:
        self._compute_into(load.entry.blocks, load.tokens, 0)

    def _prefill_reuse(self, chunks, suffix, mode, ratio, blend: BlendConfig, stats, fetch=None, on_computed=None,
                       ids=None, keep_tables=True):
        placed = self._place(chunks, mode, stats, fetch, on_computed, ids)
        pinned = [p.entry for p in placed]
        private: list[int] = []
        try:
            path = reuse_path(self, placed, suffix, mode, ratio, blend.check_layer)
            if path == "blend_graph":
                return blend_tail.blend_tail_pass(self, placed, chunks, pinned, private, suffix, ratio, blend.deviation,
                                                  stats, keep_tables)
            if path == "reuse_graph":
                return reuse_tail.reuse_tail_pass(self, placed, chunks, pinned, private, suffix, stats, keep_tables)
            return blend_pass(self, placed, chunks, pinned, private, suffix, mode, ratio, blend, stats, keep_tables)
        except BaseException:
            for e in pinned:
                self.cache.release(e)
            self.pool.free(private)
            raise

    # ------------------------------------------------------------------ decode
    def decode_step(self, seqs: list[Sequence], tokens: list[int]) -> torch.Tensor:
        dev, bs = self.device, self.bs
        blocks, slots = [], []
        for seq in seqs:
            if seq.released:
                raise RuntimeError("decode_step on a released sequence")
            if seq.gen_count == len(seq.gen_blocks) * bs:
                seq.gen_blocks += self.cache.allocate(1, for_cache=False)
            blocks.append(seq.gen_blocks[seq.gen_count // bs])
            slots.append(seq.gen_count % bs)
        positions = [s.next_pos for s in seqs]
        for seq in seqs:
            seq.gen_count += 1
            seq.next_pos += 1
        # the step replayed as a CUDA graph when it fits a bucket (graphs/decode.py) and every policy replays
        if self.static_tails and all(s.decode.replays_graph for s in seqs):
            if self.decode_graphs is None:
                from services.engine.graphs.decode import DecodeGraphs

                self.decode_graphs = DecodeGraphs(self)
            logits = self.decode_graphs.run(seqs, tokens, blocks, slots, positions)
            if logits is not None:
                return logits
        gen_tables = [BlockTable.for_run(s.gen_blocks, s.gen_count, bs, 0, dev) for s in seqs]
        # the batch grouped by decode policy once a step (one group, every row, when it has one policy), each
        # group's part of the step begun once
        groups = self._policy_groups(seqs, dev)
        steps = [policy.begin(self, [seqs[i] for i in rows]) for policy, rows, _ in groups]
        n = len(seqs)
        # Layers share table objects (one or two distinct per sequence), so each group's batch table and its
        # bounds are built once per distinct combination: the same tensors at every layer let the
        # kernels reuse their packed metadata (one validation and packing per combination, not per layer).
        batch: dict[tuple, list[tuple[BlockTable, torch.Tensor]]] = {}

        def tables_at(layer: int) -> list[tuple[BlockTable, torch.Tensor]]:
            key = tuple(id(s.layer_tables[layer]) for s in seqs)
            if key not in batch:
                batch[key] = [self._step_table(layer, [seqs[i] for i in rows], [gen_tables[i] for i in rows], dev)
                              for _, rows, _ in groups]
            return batch[key]

        # a policy whose attention waits for the host (retrieval): the rest of each layer replayed as graphs
        if self.static_tails and len(groups) == 1 and groups[0][0].layer_graphs:
            if self.layer_graphs is None:
                from services.engine.graphs.layers import LayerGraphs

                self.layer_graphs = LayerGraphs(self)
            logits = self.layer_graphs.run(tokens, positions, blocks, slots,
                                           lambda layer, q: self._decode_attend(layer, q, steps, groups,
                                                                                tables_at(layer)))
            if logits is not None:
                for st in steps:
                    st.end()
                return logits
        block = host_to_device(blocks, torch.long, dev)
        slot = host_to_device(slots, torch.long, dev)
        pos = host_to_device(positions, torch.long, dev)
        self.pool.slot_pos[block, slot] = pos.to(torch.int32)
        h = self.model.embed(host_to_device(tokens, torch.long, dev))
        joined: list[tuple[int, PolicyStep]] = []   # (group, step) whose past rows follow the batch's, in order
        for layer in range(self.cfg.num_layers):
            q, _, _ = self.model.attention_inputs(layer, h, pos, write=self.pool.at(layer, block, slot))
            tables = tables_at(layer)
            attn = self._decode_attend(layer, q[:n] if joined else q, steps, groups, tables)
            if joined:   # past rows (RetroAttention) re-embedding: their attention here, after the current rows'
                attn = torch.cat([attn] + [st.attend_past(layer, *tables[g]) for g, st in joined])
            for g, st in enumerate(steps):
                idx = groups[g][2]
                past = st.join(layer, h[:n] if idx is None else h[idx])
                if past is not None:
                    joined.append((g, st))
                    h, attn = torch.cat([h, past.h]), torch.cat([attn, past.attn.to(attn.dtype)])
                    pos, block, slot = torch.cat([pos, past.pos]), torch.cat([block, past.block]), torch.cat(
                        [slot, past.slot])
            h = self.model.finish_layer(layer, h, attn)
        logits = self.model.logits(h[:n] if joined else h)
        for st in steps:
            st.end()
        return logits

    @staticmethod
    def _policy_groups(seqs: list[Sequence], dev) -> list[tuple]:
        """[(policy, rows, rows on the device or None)] in first-seen order; equal policies share a group."""
        rows: dict = {}
        for i, s in enumerate(seqs):
            rows.setdefault(s.decode, []).append(i)
        if len(rows) == 1:
            return [(seqs[0].decode, list(range(len(seqs))), None)]
        return [(policy, r, host_to_device(r, torch.long, dev)) for policy, r in rows.items()]

    @staticmethod
    def _step_table(layer: int, seqs: list[Sequence], gen_tables: list[BlockTable], dev):
        """(one table of the sequences' entries at ``layer`` then their generated tokens, int32 cu bounds)."""
        per_seq = [BlockTable.cat([s.layer_tables[layer], g]) for s, g in zip(seqs, gen_tables)]
        cu = np.cumsum([0] + [t.num_entries for t in per_seq])
        return BlockTable.cat(per_seq), host_to_device(cu, torch.int32, dev)   # pinned, asynchronous

    def _decode_attend(self, layer: int, q: torch.Tensor, steps: list[PolicyStep], groups, tables):
        """A step's attention at one layer, each sequence through its decode policy (services/engine/decode): one
        call for the whole batch when it has one policy, else one per policy over its rows, put back in order."""
        if len(groups) == 1:
            return steps[0].attend(layer, q, *tables[0])
        out = torch.empty_like(q)
        for st, (_, _, idx), (table, cu) in zip(steps, groups, tables):
            out[idx] = st.attend(layer, q[idx], table, cu)
        return out
