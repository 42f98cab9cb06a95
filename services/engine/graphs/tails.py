"""Static-shape layer tails, replayed as CUDA graphs.

A short pass (a 64-token suffix over 32 layers) is bound by kernel launches, not by the GPU: the
same layers run for a fixed set of active tokens against one block table. ``StaticTail`` runs layers
[first, L) with every input in a preallocated buffer whose shape is a bucket (tokens padded to a
multiple of 16, block-table entries to a multiple of 256 key slots), so one captured graph serves
every request of that bucket. Attention goes through the engine's backend, in a capturable form:
  - ``TritonStatic``: the deferred-RoPE paged prefill kernel on the padded table, packed into fixed
    buffers inside the graph; nothing is gathered, rotated in memory or masked by a tensor.
  - ``TorchStatic``: every slot of the table gathered flat with its keys rotated (one fused kernel on
    CUDA), then SDPA with an additive mask (visible, and causal by global position). Hidden twins and
    padding slots are gathered and masked, so no nonzero (a sync) sizes the keys.
Padding is inert: padded entries name the reserved scratch block with no slot visible, padded queries
write their K/V to the scratch block and see no key (Triton: position -1, output 0) or every visible
key (SDPA: no empty softmax row). ``fill`` runs outside the graph with a few copies and never syncs
with the GPU (bounds are checked on the host); what can be derived from the static buffers (the SDPA
mask, RoPE tables, the Triton kernel's packed table and query positions) is derived inside the graph.
On the CPU the same static code runs eagerly (that is how the tests check it equals the eager path).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from kernels.options import current
from kernels.rope import rope_cos_sin
from services.engine.attention import PAD_POS

T_BUCKET, KEY_BUCKET, MAX_GRAPHS = 16, 256, 24
STATIC_MAX_TOKENS = 1024  # longer passes keep the GPU busy on their own: they run eagerly (flash path)


def capture(body, graph_pool) -> torch.cuda.CUDAGraph:
    """``body`` run once on a side stream (allocator, kernel selection and Triton compiles settle; the
    callers' bodies are idempotent), then captured into a graph drawing on ``graph_pool``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: a service's other threads (gRPC, KV streaming, hand-off imports) may touch CUDA meanwhile
    with torch.cuda.graph(graph, pool=graph_pool, capture_error_mode="thread_local"):
        body()
    return graph


def bucket(n: int, step: int) -> int:
    return max(step, -(-n // step) * step)


def entry_bucket(n_entries: int, block_size: int) -> int:
    """Entries padded to a multiple of KEY_BUCKET key slots."""
    return bucket(n_entries, max(1, KEY_BUCKET // block_size))


class StaticTail:
    """Layers [first, L) of t token rows: hidden states ``h`` [t, hidden] and ``tokens`` int64 [3, t]
    (position, write block, write slot) in fixed buffers, the table in the attention's buffers.
    Padded rows sit at PAD_POS and write to the scratch block; their hidden states are whatever the
    buffer held (finite: zeros or an earlier request's rows), and no real row reads them.
    ``with_qkv``: layer ``first`` arrives half done (its q, k, v computed for more rows than go on, as
    at the blend's check layer): the graph starts at its K/V write, so the rest of that layer is
    replayed too; the rows that go on are gathered straight into the buffers."""

    def __init__(self, fwd, first: int, t: int, e: int, graph_pool=None, with_qkv: bool = False, attention=None):
        cfg, dev, dt = fwd.cfg, fwd.device, fwd.pool.k[0].dtype
        self.fwd, self.first, self.t = fwd, first, t
        self.h = torch.zeros(t, cfg.hidden_size, device=dev, dtype=dt)
        self.qkv = None
        if with_qkv:
            self.qkv = (torch.zeros(t, cfg.num_heads, cfg.head_dim, device=dev, dtype=dt),
                        torch.zeros(t, cfg.num_kv_heads, cfg.head_dim, device=dev, dtype=dt),
                        torch.zeros(t, cfg.num_kv_heads, cfg.head_dim, device=dev, dtype=dt))
        # q/k RoPE: a model with a kernel backend rotates by position in one kernel each; the torch
        # model takes cos/sin tables, made inside the graph from the static positions (its own rope
        # memo would be frozen into the graph)
        self.rope_by_pos = fwd.model.rope_backend != "torch"
        self.tokens = torch.zeros(3, t, dtype=torch.long, device=dev)
        self.tokens[0] = PAD_POS
        self.tokens[1] = fwd.scratch_block
        self.tokens[2] = torch.arange(t, device=dev) % fwd.pool.block_size  # padded rows' scratch slots
        self._pad = self.tokens.clone()
        self._filled = 0
        # the layers' attention: prepare(pos) once a replay, then (layer, q) -> out; the backend's over a padded
        # table unless the caller brings its own
        self.attention = attention if attention is not None else fwd.attention.static_prefill(fwd, t, e)
        self.out = torch.zeros_like(self.h)
        self.graph = None
        self.kernel_options = None  # set at capture
        self.graph_pool = graph_pool

    def _body(self) -> None:
        fwd = self.fwd
        model, pool = fwd.model, fwd.pool
        pos, w_block, w_slot = self.tokens
        self.attention.prepare(pos)
        if not self.rope_by_pos:
            cos, sin = rope_cos_sin(pos, model.inv_freq)
            rope = (cos[:, None, :], sin[:, None, :])
        h = self.h
        for layer in range(self.first, fwd.cfg.num_layers):
            if layer == self.first and self.qkv is not None:
                q, k, v = self.qkv  # made before the graph: written here
                pool.write(layer, w_block, w_slot, k, v)
            else:  # k, v stored by the q|k|v kernel itself (padded rows to the scratch block)
                write = pool.at(layer, w_block, w_slot)
                if self.rope_by_pos:
                    q, _, _ = model.attention_inputs(layer, h, pos, write=write)
                else:
                    q, _, _ = model.attention_inputs(layer, h, None, rope=rope, write=write)
            h = model.finish_layer(layer, h, self.attention(layer, q))
        self.out.copy_(h)

    def fill(self, h, pos, table, w_block, w_slot, qkv=None, rows=None, tokens=None) -> None:
        """Load one request's inputs into the static buffers: tokens h [n] at positions pos [n],
        writing their K/V at (w_block, w_slot) [n], attending ``table``. With ``rows`` [n], h (and
        each of ``qkv``, layer first's q, k, v) hold more rows, and rows says which go on.
        ``tokens``: pos, w_block, w_slot as the rows of one [3, n] tensor (one copy fewer)."""
        n = pos.shape[0]
        if rows is None:
            self.h[:n] = h
        else:
            torch.index_select(h, 0, rows, out=self.h[:n])
            for src, buf in zip(qkv, self.qkv):
                torch.index_select(src, 0, rows, out=buf[:n])
        self.tokens[:, :n] = tokens if tokens is not None else torch.stack([pos, w_block, w_slot])
        if n < self._filled:  # rows of a longer request become padding again
            self.tokens[:, n:self._filled] = self._pad[:, n:self._filled]
        self._filled = n
        self.attention.fill(table)

    def run(self) -> torch.Tensor:
        if self.h.device.type != "cuda":
            self._body()
            return self.out
        if self.graph is None:
            self.graph = capture(self._body, self.graph_pool)
            self.kernel_options = current()  # what its launches were captured with (kernels/options.py)
        self.graph.replay()
        return self.out


class KeyedTails:
    """Tails made by ``make(*key)`` on first use, by key, least recently used dropped (MAX_GRAPHS kept);
    they share the engine's graph memory pool with its other static tails."""

    def __init__(self, make):
        self.make = make
        self.tails: OrderedDict[tuple, StaticTail] = OrderedDict()
        self.replays = 0

    def get(self, *key):
        tail = self.tails.get(key)
        if tail is None:
            if len(self.tails) >= MAX_GRAPHS:
                self.tails.popitem(last=False)
            tail = self.tails[key] = self.make(*key)
        self.tails.move_to_end(key)
        return tail


class TailCache(KeyedTails):
    """StaticTails by (first layer, token bucket, entry bucket, half-done first layer); the engine's graph memory
    pool, which its other tails share."""

    def __init__(self, fwd):
        self.fwd = fwd
        self.graph_pool = torch.cuda.graph_pool_handle() if fwd.device.type == "cuda" else None
        super().__init__(lambda first, t, e, qkv: StaticTail(fwd, first, t, e, self.graph_pool, qkv))

    def run(self, first, h, pos, table, w_block, w_slot, qkv=None, rows=None, tokens=None) -> torch.Tensor:
        """h after layers [first, L) for tokens h [n, hidden] at pos [n] against ``table``; see
        StaticTail.fill for ``qkv``, ``rows`` and ``tokens``."""
        n = pos.shape[0]
        tail = self.get(first, bucket(n, T_BUCKET), entry_bucket(table.num_entries, self.fwd.pool.block_size),
                        qkv is not None)
        tail.fill(h, pos, table, w_block, w_slot, qkv, rows, tokens)
        self.replays += 1
        return tail.run()[:n]
