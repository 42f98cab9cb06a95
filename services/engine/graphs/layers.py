"""Decode steps whose attention cannot be captured, their other work replayed as CUDA graphs, a graph a layer.

A retrieval decode step (decode/retrieval.py) waits for the host at every layer: its attention sends the layer's
queries to the CPU index and merges what comes back, so the step cannot be one graph (``DecodeGraph``) and ran
eagerly, its ~20 launches a layer costing more than the GPU's work (our dense step at 32K, eager against a graph:
31 against 6.4 ms on an H200). ``LayerGraphs`` cuts the step at its attentions: graph ``l`` runs what lies between
layer l - 1's attention and layer l's,
    l = 0:        slot positions, embedding, layer 0's q|k|v (K/V written to the pool)
    0 < l < L:    layer l - 1's o-projection and MLP, then layer l's q|k|v
    l = L:        layer L - 1's o-projection and MLP, the logits,
on fixed buffers of a batch bucket (tokens, positions, write blocks and slots; the hidden states; q; the attention
output), and the step's policy attends eagerly in between, reading q and writing the attention output in place.
Each graph reads one hidden-state buffer and writes the other (they alternate by layer), so running a graph twice,
as its capture does, gives what running it once does. Padded rows (the bucket's rows past the batch) are inert:
token 0 at position 0, their K/V written to the scratch block, their attention output left as it was (finite), their
logits never read. On the CPU the same bodies run eagerly (that is how the tests check the path). Used by
``Forward.decode_step`` for a batch of one policy whose ``layer_graphs`` is set."""

from __future__ import annotations

import torch

from kernels.rope import rope_cos_sin
from services.engine.graphs.decode import BATCH_BUCKETS
from services.engine.graphs.tails import capture


class _LayerSet:
    """The graphs of one batch bucket ``b``: buffers, and a graph per layer boundary (made on first use)."""

    def __init__(self, fwd, b: int, graph_pool):
        cfg, dev, dtype = fwd.cfg, fwd.device, fwd.pool.k[0].dtype
        self.fwd, self.b, self.graph_pool = fwd, b, graph_pool
        self.idx = torch.zeros(4, b, dtype=torch.int64, device=dev)    # tokens, positions, write blocks, slots
        self.h = [torch.zeros(b, cfg.hidden_size, dtype=dtype, device=dev) for _ in range(2)]
        self.q = torch.zeros(b, cfg.num_heads, cfg.head_dim, dtype=dtype, device=dev)
        self.attn = torch.zeros(b, cfg.num_heads, cfg.head_dim, dtype=dtype, device=dev)
        self.logits = torch.zeros(b, cfg.vocab_size, dtype=torch.float32, device=dev)
        self.graphs: list = [None] * (cfg.num_layers + 1)
        # the torch model memoises cos/sin by position tensor: made in the graph from the positions buffer instead
        self.rope_by_pos = fwd.model.rope_backend != "torch"
        self.pad_slots = torch.arange(b, dtype=torch.int64) % fwd.bs

    def fill(self, tokens, positions, blocks, slots) -> None:
        """This step's rows; the bucket's other rows padded."""
        n, b, fwd = len(tokens), self.b, self.fwd
        host = torch.zeros(4, b, dtype=torch.int64)
        host[2] = fwd.scratch_block
        host[3] = self.pad_slots
        for i, row in enumerate((tokens, positions, blocks, slots)):
            host[i, :n] = torch.as_tensor(row, dtype=torch.int64)
        cuda = self.idx.device.type == "cuda"
        self.idx.copy_(host.pin_memory() if cuda else host, non_blocking=cuda)

    def body(self, layer: int) -> None:
        fwd = self.fwd
        model, pool, last = fwd.model, fwd.pool, fwd.cfg.num_layers
        tokens, pos, block, slot = self.idx
        if layer == 0:
            pool.slot_pos[block, slot] = pos.to(torch.int32)
            h = model.embed(tokens)
        else:
            h = model.finish_layer(layer - 1, self.h[(layer - 1) % 2], self.attn)
        if layer == last:
            self.logits.copy_(model.logits(h))
            return
        rope = None
        if not self.rope_by_pos:
            cos, sin = rope_cos_sin(pos, model.inv_freq)
            rope = (cos[:, None, :], sin[:, None, :])
        q, _, _ = model.attention_inputs(layer, h, pos, rope=rope, write=pool.at(layer, block, slot))
        self.h[layer % 2].copy_(h)
        self.q.copy_(q)

    def replay(self, layer: int) -> None:
        if self.logits.device.type != "cuda":
            self.body(layer)
            return
        graph = self.graphs[layer]
        if graph is None:
            graph = self.graphs[layer] = capture(lambda: self.body(layer), self.graph_pool)
        graph.replay()


class LayerGraphs:
    """``_LayerSet``s by batch bucket (``BATCH_BUCKETS``); a batch past the largest runs eagerly (``run`` gives
    None)."""

    def __init__(self, fwd):
        self.fwd = fwd
        self.sets: dict[int, _LayerSet] = {}
        self.graph_pool = torch.cuda.graph_pool_handle() if fwd.device.type == "cuda" else None
        self.steps = 0

    def run(self, tokens, positions, blocks, slots, attend) -> torch.Tensor | None:
        """Logits [n, vocab] of a step of n rows (their K/V written at (blocks, slots), positions [n]), each layer's
        attention by ``attend(layer, q [n, Hq, D]) -> [n, Hq, D]``; None when n is past the largest bucket."""
        n = len(tokens)
        if not 0 < n <= BATCH_BUCKETS[-1]:
            return None
        if min(tokens) < 0 or max(tokens) >= self.fwd.cfg.vocab_size:
            raise ValueError(f"a token id is outside the vocabulary [0, {self.fwd.cfg.vocab_size})")
        b = next(x for x in BATCH_BUCKETS if x >= n)
        st = self.sets.get(b)
        if st is None:
            st = self.sets[b] = _LayerSet(self.fwd, b, self.graph_pool)
        st.fill(tokens, positions, blocks, slots)
        for layer in range(self.fwd.cfg.num_layers):
            st.replay(layer)
            st.attn[:n].copy_(attend(layer, st.q[:n]))
        st.replay(self.fwd.cfg.num_layers)
        self.steps += 1
        return st.logits[:n].clone()   # the buffer is the next step's: the caller gets its own
