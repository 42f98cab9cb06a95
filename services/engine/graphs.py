"""Static-shape layer tails, replayed as CUDA graphs.

A short pass (a 64-token suffix over 32 layers) is bound by kernel launches, not by the GPU: the
same layers run for a fixed set of active tokens against one block table. ``StaticTail`` runs layers
[first, L) with every input in a preallocated buffer whose shape is a bucket (tokens padded to a
multiple of 16, keys to a multiple of 256), so one captured graph serves every request of that
bucket. Padding is inert: padded queries see one real key and write to a reserved scratch block,
padded keys are masked out and read the scratch block. On the CPU the same static code runs eagerly
(that is how the tests check it equals the eager path).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F

from kernels.rope import rope_cos_sin, rotate
from services.engine.attention import visible_keys

T_BUCKET, S_BUCKET, MAX_GRAPHS = 16, 256, 24
STATIC_MAX_TOKENS = 1024  # longer passes keep the GPU busy on their own: they run eagerly (flash path)


def bucket(n: int, step: int) -> int:
    return max(step, -(-n // step) * step)


class StaticTail:
    def __init__(self, fwd, first: int, t: int, s: int, rotate_keys: bool, graph_pool=None):
        cfg, dev, dt = fwd.cfg, fwd.device, fwd.pool.k[0].dtype
        self.fwd, self.first, self.t, self.s, self.rotate_keys = fwd, first, t, s, rotate_keys
        half = cfg.head_dim // 2
        self.h = torch.zeros(t, cfg.hidden_size, device=dev, dtype=dt)
        self.q_cos = torch.ones(t, 1, half, device=dev)
        self.q_sin = torch.zeros(t, 1, half, device=dev)
        self.w_block = torch.zeros(t, dtype=torch.long, device=dev)
        self.w_slot = torch.zeros(t, dtype=torch.long, device=dev)
        self.k_idx = torch.zeros(s, dtype=torch.long, device=dev)
        self.k_cos = torch.ones(s, 1, half, device=dev)
        self.k_sin = torch.zeros(s, 1, half, device=dev)
        self.mask = torch.zeros(1, 1, t, s, dtype=torch.bool, device=dev)
        self.out = torch.zeros_like(self.h)
        self.graph = None
        self.graph_pool = graph_pool

    def _body(self) -> None:
        fwd = self.fwd
        model, pool = fwd.model, fwd.pool
        h = self.h
        group = fwd.cfg.num_heads // fwd.cfg.num_kv_heads
        for layer in range(self.first, fwd.cfg.num_layers):
            q, k, v = model.attention_inputs(layer, h, None, rope=(self.q_cos, self.q_sin))
            pool.write(layer, self.w_block, self.w_slot, k, v)
            kc, vc = pool.k[layer], pool.v[layer]
            keys = kc.view(-1, *kc.shape[2:])[self.k_idx]
            vals = vc.view(-1, *vc.shape[2:])[self.k_idx]
            if self.rotate_keys:
                keys = rotate(keys, self.k_cos, self.k_sin)
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                                 vals.transpose(0, 1)[None], attn_mask=self.mask,
                                                 scale=model.scale, enable_gqa=group > 1)
            h = model.finish_layer(layer, h, out[0].transpose(0, 1))
        self.out.copy_(h)

    def fill(self, h, pos, keys, w_block, w_slot) -> None:
        """Load one request's inputs into the static buffers: tokens h [n], pos [n], and the
        table's ``visible_keys`` (idx, k_pos, cos, sin)."""
        fwd, n = self.fwd, h.shape[0]
        n_slots = fwd.pool.slot_pos.shape[1]
        scratch = fwd.scratch_block
        self.h.zero_()
        self.h[:n] = h
        cos, sin = rope_cos_sin(pos, fwd.model.inv_freq)
        self.q_cos.fill_(1.0)
        self.q_sin.zero_()
        self.q_cos[:n, 0] = cos
        self.q_sin[:n, 0] = sin
        self.w_block.fill_(scratch)
        self.w_slot.copy_(torch.arange(self.t, device=h.device) % n_slots)
        self.w_block[:n] = w_block
        self.w_slot[:n] = w_slot
        idx, k_pos, k_cos, k_sin = keys
        m = int(idx.numel())
        if m > self.s:
            raise RuntimeError(f"{m} keys do not fit a static tail of {self.s}")
        self.k_idx.fill_(scratch * n_slots)
        self.k_idx[:m] = idx
        self.k_cos.fill_(1.0)
        self.k_sin.zero_()
        if self.rotate_keys:
            self.k_cos[:m] = k_cos
            self.k_sin[:m] = k_sin
        self.mask.zero_()
        self.mask[0, 0, :n, :m] = k_pos[None, :] <= pos.long()[:, None]
        self.mask[0, 0, n:, 0] = True  # padded queries see one real key: no empty softmax row

    def run(self) -> torch.Tensor:
        if self.h.device.type != "cuda":
            self._body()
            return self.out
        if self.graph is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._body()  # warm-up: allocator and kernel selection settle before capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                self._body()
            self.graph = graph
        self.graph.replay()
        return self.out


class TailCache:
    """StaticTails by (first layer, token bucket, key bucket, rotation), least recently used dropped."""

    def __init__(self, fwd):
        self.fwd = fwd
        self.tails: OrderedDict[tuple, StaticTail] = OrderedDict()
        self.graph_pool = torch.cuda.graph_pool_handle() if fwd.device.type == "cuda" else None
        self.replays = 0

    def run(self, first, h, pos, table, w_block, w_slot) -> torch.Tensor:
        """h after layers [first, L) for tokens h [n, hidden] at pos [n] against ``table``."""
        n = h.shape[0]
        keys = visible_keys(self.fwd.pool, table, self.fwd.model.inv_freq)
        key = (first, bucket(n, T_BUCKET), bucket(int(keys[0].numel()), S_BUCKET), table.max_offset > 0)
        tail = self.tails.get(key)
        if tail is None:
            if len(self.tails) >= MAX_GRAPHS:
                self.tails.popitem(last=False)
            tail = self.tails[key] = StaticTail(self.fwd, first, key[1], key[2], key[3], self.graph_pool)
        self.tails.move_to_end(key)
        tail.fill(h, pos, keys, w_block, w_slot)
        self.replays += 1
        return tail.run()[:n]
