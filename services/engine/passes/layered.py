"""The layer-major prefill of a retrieval decode: a context larger than the GPU's KV pool is served.

The ordinary pass (passes/forward.py) runs every layer over the request's new tokens and keeps every layer's K/V in
the pool; a retrieval sequence then sends what it offloads to the host (decode/retrieval.py ``offload``) and keeps
its static set. So its context must fit the pool first. This pass runs the other way round: every token through
layer 0, then every token through layer 1, and so on, one layer's K/V at a time in a buffer of its own:

- at each layer the tokens' q, k and v are made in slices of ``SLICE_TOKENS`` (the projections and the MLP hold a
  slice's activations only), the keys and values written to the buffer, the queries kept; then one causal attention
  over the whole layer (torch SDPA, cuDNN's flash kernel on a GPU, as the plain causal passes); then the MLP, again
  in slices (at the last layer for the last token only: the logits need no other);
- the static set's K/V (the pages showing the first ``sink_tokens`` positions and the last ``window_tokens``, the
  positions laid densely from 0) are written into the pool, the only pool blocks the sequence holds;
- everything else of the layer goes to the copy thread while the next layer computes: rounded to the index set's
  dtype, ranked against the layer's tapped queries on the GPU (``exact_lists``) and copied to the host; the builder
  thread builds its indexes as it arrives, so the builds start with the pass, not after it (and, with
  ``EngineOptions.decode_while_building``, each copied layer is held to be scanned until it is indexed: the sequence
  steps once the last layer is copied).

The sequence leaves the pass as an ordinary retrieval sequence does once settled: tables holding its static set,
indexes building (``Offload.build``). What it holds on the GPU beside the pool: the hidden states, the queries and
the attention output of every token (bf16 [N, hidden] and 2 x [N, Hq, D]) and one layer's K/V, plus the layers waiting
for the copy thread (at most ``COPY_BYTES``, at least one): ~18 GiB for 512K tokens of an 8B-shaped model, against the
64 GiB its K/V take over all layers.

Only ``full`` computes here (every token in its context): a mode that reuses cached chunks holds them in the pool.
"""

from __future__ import annotations

import contextlib
import queue
import time

import torch
import torch.nn.functional as F

from kernels.fused import KVWrite
from services.engine.decode.retrieval import (HostStaging, Offload, QueryTap, RetrievalDecode, _build, _builder,
                                              _copier, by_kv_head, copy_stream, held_dtype, hold, holds, host_layer,
                                              index_set, new_owner)
from services.engine.request import PrefillStats, Sequence

# query rows a slice of the projections and the MLP: the MLP's activations of 16K rows of an 8B-shaped model are
# ~1.4 GB (bf16)
SLICE_TOKENS = 16384
# NOTE: offloaded K/V waiting on the GPU for the copy thread (whole layers, at least one) before the pass waits for
# it: the copy thread ranks each layer's keys for its training queries (``exact_lists``) and copies them out, slower
# than a layer computes at short contexts. At a depth of two layers a 32K-token pass of an 8B-shaped model's first 8
# layers took 1.50-1.66 s against the ordinary pass's 0.52-0.57 (bench/decode/README.md)
COPY_BYTES = 4 << 30


def static_bounds(n: int, policy: RetrievalDecode, block_size: int) -> tuple[int, int]:
    """(end of the sink pages, start of the window pages) of n positions laid densely over pages from 0: whole pages
    showing a position below ``sink_tokens`` or at or after n - ``window_tokens``. Positions [sink_end, window_start)
    are offloaded."""
    sink_end = min(n, -(-policy.sink_tokens // block_size) * block_size)
    window_start = n if policy.window_tokens == 0 else (max(0, n - policy.window_tokens) // block_size) * block_size
    return sink_end, max(sink_end, window_start)


def layered_prefill(fwd, ids: list[int], policy: RetrievalDecode, tap: QueryTap, stats: PrefillStats):
    """Prefill ``ids`` (the whole context, positions 0..N-1) layer by layer for ``policy`` (retrieving keys:
    ``retrieval_k`` > 0): (next-token logits [vocab], the Sequence, its offload under way). ``tap`` takes the pass's
    queries (each layer's are used, and dropped, once the layer is done)."""
    cfg, pool, dev = fwd.cfg, fwd.pool, fwd.device
    n = len(ids)
    t0 = time.perf_counter()
    sink_end, window_start = static_bounds(n, policy, fwd.bs)
    static_pos = torch.cat([torch.arange(0, sink_end, device=dev), torch.arange(window_start, n, device=dev)])
    indexes = index_set(fwd)
    off = Offload(new_owner(), holds=holds(fwd, policy))
    blocks, s_block, s_slot, table = fwd._private(static_pos)
    stats.private_blocks_allocated += len(blocks)
    stats.chunk_tokens_computed += stats.chunk_tokens
    layer_bytes = 2 * (window_start - sink_end) * cfg.num_kv_heads * cfg.head_dim * pool.k[0].element_size()
    inbox: queue.Queue = queue.Queue(max(1, COPY_BYTES // max(1, layer_bytes)))
    copied_layers: queue.SimpleQueue = queue.SimpleQueue()
    copy = _copier(fwd).submit(_copy_streamed, fwd, off, inbox, copied_layers)
    off.build = _builder(fwd).submit(_build, indexes, off, copy, copied_layers)
    try:
        logits = _layers(fwd, ids, inbox, copy, tap, static_pos, s_block, s_slot, sink_end, window_start)
    except BaseException:
        off.cancelled = True
        inbox.put(None)
        with contextlib.suppress(Exception):      # the pass's own error is the one raised
            off.build.result()
        pool.free(blocks)
        raise
    inbox.put(None)
    off.static = [table.num_entries] * cfg.num_layers
    off.offloaded = [window_start - sink_end] * cfg.num_layers
    off.seconds["pass"] = stats.forward_seconds = time.perf_counter() - t0
    seq = Sequence([table] * cfg.num_layers, [], blocks, n)
    seq.offload = off
    return logits, seq


def _layers(fwd, ids, inbox, copy, tap, static_pos, s_block, s_slot, sink_end, window_start) -> torch.Tensor:
    """The pass itself (``layered_prefill``): the last token's logits."""
    cfg, pool, model, dev = fwd.cfg, fwd.pool, fwd.model, fwd.device
    n, bs = len(ids), fwd.bs
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    g = hq // hkv
    k_buf = torch.empty((-(-n // bs), bs, hkv, d), dtype=pool.k[0].dtype, device=dev)   # one layer's K/V, dense
    v_buf = torch.empty_like(k_buf)
    k_flat, v_flat = k_buf.view(-1, hkv, d)[:n], v_buf.view(-1, hkv, d)[:n]
    pos = torch.arange(n, device=dev)
    block, slot = pos // bs, pos % bs
    h = model.embed(torch.as_tensor(ids, dtype=torch.long).to(dev))
    q_all = torch.empty((n, hq, d), dtype=h.dtype, device=dev)
    cuts = list(zip(range(0, n, SLICE_TOKENS), [*range(SLICE_TOKENS, n, SLICE_TOKENS), n]))
    for layer in range(cfg.num_layers):
        for a, b in cuts:
            q_all[a:b] = model.attention_inputs(layer, h[a:b], pos[a:b],
                                                write=KVWrite(k_buf, v_buf, block[a:b], slot[a:b]))[0]
        if copy.done():
            copy.result()          # the copy thread stopped early: its error ends the pass
        attn = F.scaled_dot_product_attention(q_all.transpose(0, 1)[None], k_flat.transpose(0, 1)[None],
                                              v_flat.transpose(0, 1)[None], is_causal=True, scale=model.scale,
                                              enable_gqa=g > 1)[0].transpose(0, 1)
        pool.write(layer, s_block, s_slot, k_flat[static_pos], v_flat[static_pos])
        tap(layer, q_all)
        q = tap.queries(layer)
        tap.layers.pop(layer, None)
        train_dev = by_kv_head(q, hkv)
        item = (k_flat[sink_end:window_start].clone(), v_flat[sink_end:window_start].clone(), train_dev,
                torch.cuda.Event() if dev.type == "cuda" else None)
        if item[3] is not None:
            item[3].record()      # the copy stream waits for it
        inbox.put(item)
        del item, train_dev, q
        if layer == cfg.num_layers - 1:
            h = model.finish_layer(layer, h[-1:], attn[-1:])    # the logits read the last token only
        else:
            for a, b in cuts:
                h[a:b] = model.finish_layer(layer, h[a:b], attn[a:b])
        del attn
    return model.logits(h)[-1]


def _copy_streamed(fwd, off: Offload, inbox: queue.Queue, copied_layers: queue.SimpleQueue) -> None:
    """The copy thread's part of a layer-major pass: each layer's offloaded keys (at their global positions) and
    values, device tensors [N, Hkv, D] taken from ``inbox`` in layer order until None, to the host with their exact
    lists (``host_layer``), each put on ``copied_layers`` for the builder, then None. After an error (or once the
    sequence is cancelled) it takes what comes until None without copying it, so the pass never waits on a full
    inbox; the error is raised after (the builder then raises it, failing the sequence)."""
    held = held_dtype(fwd)
    t0 = time.perf_counter()
    error: BaseException | None = None
    stream = copy_stream(fwd.device) if fwd.device.type == "cuda" else None
    staging = HostStaging()
    layer = 0
    try:
        while True:
            item = inbox.get()
            if item is None:
                break
            if error is None and not off.cancelled:
                try:
                    k, v, train_dev, after = item
                    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                        if stream is not None:
                            stream.wait_event(after)
                        item = host_layer(k, v, train_dev.cpu().numpy(), train_dev, [], held, staging)
                    hold(fwd, off, layer, item)
                    copied_layers.put(item)
                except BaseException as exc:    # raised once the pass is over
                    error = exc
                k = v = train_dev = None
            item = None             # (its copies were waited for: nothing of it is in flight)
            layer += 1
        if off.holds and error is None and not off.cancelled and layer == fwd.cfg.num_layers:
            off.held.set()          # every layer held: the sequence may step (before ``copied``: ``Offload.wait``)
    finally:
        off.seconds["keys"] = time.perf_counter() - t0
        off.copied.set()
        copied_layers.put(None)
    if error is not None:
        raise error
