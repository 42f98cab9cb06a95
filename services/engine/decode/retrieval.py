"""Retrieval decode (decode="retrieval", RetrievalAttention): each query attends a small static set of pages on the GPU
and the top ``retrieval_k`` keys of everything else, found by an attention-aware index on the CPU; the two partial
results merge by log-sum-exp.

Static set, per layer (whole pages: a page is static when any token it shows is): the pages showing the sequence's
first ``sink_tokens`` positions, those showing its prompt's last ``window_tokens`` positions, and every generated
token's page. Every other token the layer's table shows is offloaded: when the sequence starts decoding
(``prepare``), its keys, rotated to their global positions (a shared chunk's keys are cached at chunk-local ones: the
entry's offset rotates them, as the attention kernels do), and its values go to the index set (services/index/heads),
which builds one ``AttentionIndex`` per (layer, KV head) from the prefill pass's queries at that layer (the engine
taps them while the pass runs: ``QueryTap``). So the static set and the offloaded keys partition what the layer
shows, and attention over both, merged, is attention over every key:
    softmax over S ∪ O  =  merge((out_S, lse_S), (out_O, lse_O))      (kernels/lse_merge)
with out_O over the retrieved keys only: exact when ``retrieval_k`` covers every offloaded key.

The K/V go to the host on a copy thread (``_copy``: its own CUDA stream, staged through pinned memory) and the
indexes build on a builder thread (``Offload.build``): a serving batch leaves the sequence out until they are
(``ready``), so its start does not hold up the others (the engine thread runs the split and the chunks' query passes
only). With ``EngineOptions.decode_while_building`` (the default) it waits for the copy alone: the copy thread holds
each copied layer in the index set with no graph (``IndexSet.hold``), searched by scanning every key, until the
builder's index replaces it, so the sequence's second token does not wait for its builds (its steps read every key
of the layers not yet indexed). Once copied (``settle``, on the engine thread), the sequence's layer tables keep
their static entries only, its private blocks that no layer keeps go back to the pool and the chunks it no longer
reads are unpinned (the chunk cache may evict them): what it holds on the GPU is its static set.

At a step, layer by layer: the query rows go to the host first (a pinned copy, waited for alone), the static set's
attention is issued on the GPU, and the CPU searches and attends while it runs; its answer goes back (pinned, in
the step's buffers) into a part left beside the static attention's KV splits, and one launch merges them all. What
lies between two layers' attentions replays as a CUDA graph (``layer_graphs``: services/engine/graphs/layers.py)
when the engine's static tails are on: 1.24x faster a token at 32K on an H200 than the step run eagerly
(bench/decode/README.md).

Shared chunks (``EngineOptions.chunk_indexes``): a chunk wholly among the offloaded tokens is searched through its own
graphs, built once in its frame (services/index/chunks.py: the chunk runs alone once to tap its queries, shifted
forward by ``CHUNK_QUERY_SHIFTS``) and kept by chunk id; the sequence's offload puts each such chunk's tokens first, as
a run in its own order (CacheBlend's recomputed tokens with their own keys), composes the graphs over its keys and
repairs the composition with its own prefill queries (links between chunks), and builds one graph for the rest.

A context larger than the pool: a request in mode ``full`` is then prefilled layer by layer (passes/layered.py), one
layer's K/V at a time outside the pool, and offloaded as the pass goes (``prepare`` finds it done). A hand-off carries
a sample of the queries
(``HANDOFF_QUERIES`` a layer) when its prefill was asked to (``tap_queries``), and a decode engine builds from those.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from kernels import sparse
from kernels.lse_merge import merge_attention
from kernels.rope import rope_cos_sin, rotate
from services.checks import check_int
from services.engine.decode.policy import DecodePolicy, PolicyStep
from services.engine.kv.block_table import BlockTable, host_to_device

# NOTE: the prefill queries kept per layer for the index (evenly strided over each tapped call): every query of
# an 8B-shaped model at 128K would be 32 GB; RoarGraph-style graphs need a sample of the query distribution only
TRAIN_QUERIES = 2048
# those a hand-off carries (fp16): 256 x 32 heads x 128 x 2 B = 2 MiB a layer of an 8B-shaped model
HANDOFF_QUERIES = 256
# NOTE: a chunk's own queries sit at its first positions, a decode query reading it far to its right: each tapped
# chunk query is used rotated forward by one of these distances (fractions of the model's positions), in turn
CHUNK_QUERY_SHIFTS = (0.0, 1 / 32, 1 / 8, 1 / 2)

_owners = itertools.count()
COPY_STREAMS: dict = {}       # the copy thread's CUDA stream a GPU (as kv/loader.py keeps one load stream a GPU)
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RetrievalDecode(DecodePolicy):
    """retrieval_k: keys retrieved per query head and layer (0: none, the static set alone: StreamingLLM's baseline);
    sink_tokens, window_tokens: the prompt's first and last positions kept on the GPU (rounded out to whole pages),
    beside every generated token."""

    retrieval_k: int = 100
    sink_tokens: int = 128
    window_tokens: int = 512
    name = "retrieval"
    replays_graph = False     # a step waits for the host at every layer
    layer_graphs = True       # what lies between those waits replays as graphs

    @property
    def taps_queries(self) -> bool:
        """Its index is built from the prefill pass's queries (the engine taps them), unless it retrieves nothing."""
        return self.retrieval_k > 0

    def __post_init__(self) -> None:
        check_int("retrieval_k", self.retrieval_k, 0)
        check_int("sink_tokens", self.sink_tokens, 0)
        check_int("window_tokens", self.window_tokens, 0)

    def prepare(self, fwd, seq) -> None:
        if seq.offload is None:        # a layer-major pass (passes/layered.py) offloaded it as it ran
            offload(fwd, seq, self)

    def begin(self, fwd, seqs):
        return RetrievalStep(self, fwd, seqs)

    def ready(self, seq) -> bool:
        """Whether its indexes are built; a failed build's error is raised here. (Once its K/V are copied, its tables
        are cut to the static set here, on the engine thread: ``settle``.)"""
        settle(seq)
        off = seq.offload
        if not (off.build.done() or off.held.is_set()):
            return False
        off.wait()              # returns at once (or once copied, set right after held), or raises the build's error
        settle(seq)
        return True

    def release(self, fwd, seq) -> None:
        off = seq.offload
        if off is None:
            return
        off.cancelled = True    # (read by the copy thread without the lock; the lock orders it before ``finished``)
        off.copied.wait()       # the copy thread stops at its next layer: the blocks may be freed after that
        with off.lock:
            if off.finished and fwd.indexes is not None and self.retrieval_k:    # retrieving nothing offloads nothing
                fwd.indexes.drop(off.owner)


class QueryTap:
    """The queries a prefill pass computes, per layer, rotated at their global positions, at most ``cap`` a layer
    (evenly strided within each call). Set as ``Forward.query_tap`` while a request's own pass runs (never while a
    chunk is computed alone: its queries are in the chunk's frame)."""

    def __init__(self, cap: int = TRAIN_QUERIES):
        self.cap = cap
        self.layers: dict[int, list[torch.Tensor]] = {}

    def __call__(self, layer: int, q: torch.Tensor) -> None:
        stride = max(1, -(-q.shape[0] // self.cap))
        self.layers.setdefault(layer, []).append(q[::stride].detach().clone())

    def queries(self, layer: int) -> torch.Tensor | None:
        """[M, Hq, D] (M <= cap), or None if the layer was not tapped."""
        parts = self.layers.get(layer)
        if not parts:
            return None
        q = torch.cat(parts)
        return q[::max(1, -(-q.shape[0] // self.cap))]

    def export(self, num_layers: int) -> tuple[torch.Tensor, ...]:
        """Every layer's queries on the host in fp16, for a hand-off (a layer not tapped: empty)."""
        out = []
        for layer in range(num_layers):
            q = self.queries(layer)
            out.append(torch.zeros(0, dtype=torch.float16) if q is None else q.to("cpu", torch.float16))
        return tuple(out)

    @classmethod
    def of(cls, layers) -> "QueryTap":
        """A tap holding given queries per layer ([M, Hq, D] each; empty ones are left out): a hand-off's."""
        tap = cls()
        for layer, q in enumerate(layers):
            if q.numel():
                tap.layers[layer] = [q]
        return tap


@dataclass(slots=True)
class Offload:
    """A retrieval sequence's offloaded part: owner (its name in the index set), static [L]: per layer the entries its
    table kept (all of them, after ``offload``), offloaded [L]: tokens offloaded (keys per KV head), seconds: where
    ``offload`` spent the engine thread's time (``split``: the tables split; ``chunks``: the shared chunks' query
    passes, for indexes not held; ``queries``: the training queries copied), and ``keys`` the copy thread's (the K/V
    gathered, rotated and copied to the host). copied: set once the copy thread is done with the sequence's blocks
    (or stopped); cut: what cuts its tables down to the static set, pending until then (``settle``). build: the
    builder thread's job adding them to the index set; cancelled / finished (under lock): the sequence was released /
    the job is over (whichever comes second drops what was added). holds: the copy thread holds each copied layer in
    the index set to be scanned until it is indexed (``hold``); held: set once every layer is (before ``copied``)."""

    owner: str
    static: list[int] = field(default_factory=list)
    offloaded: list[int] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    build: Future | None = None
    cancelled: bool = False
    finished: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    copied: threading.Event = field(default_factory=threading.Event)
    cut: Callable[[], None] | None = None
    holds: bool = False
    held: threading.Event = field(default_factory=threading.Event)

    def wait(self) -> None:
        """Until the sequence can step: its indexes built, or (``holds``) every layer's K/V held and copied, each
        layer scanned whole until its index replaces it (``IndexSet.hold``). A build's error is raised unless the
        K/V are held: the layers it did not index are then scanned (logged)."""
        while True:
            if self.held.is_set():
                self.copied.wait()
                return
            try:
                self.build.result(timeout=0.05)
                return
            except FutureTimeout:
                continue
            except Exception as exc:
                self.copied.wait()              # (held, when it is, is set before copied)
                if not self.held.is_set():
                    raise
                log.warning("the index build of %s failed (%s): its layers not indexed are scanned", self.owner, exc)
                return


def offload(fwd, seq, policy: RetrievalDecode) -> None:
    """Split each layer's table into the static pages and the offloaded tokens, and hand the latter (keys at global
    positions, values, the tapped queries, and the graphs of the shared chunks wholly among them) to the index set."""
    if policy.retrieval_k:
        index_set(fwd)
    layers: list = []   # per layer, what the builder thread adds: keys, values [Hkv, N, D], queries [Hkv, M, D], runs
    pool, bs = fwd.pool, fwd.bs
    hkv = fwd.cfg.num_kv_heads
    prompt = seq.next_pos
    owner = new_owner()
    off = Offload(owner, holds=holds(fwd, policy))
    bits = torch.arange(bs, device=fwd.device, dtype=torch.int64)
    split: dict[int, tuple] = {}   # per distinct table object: (static entries, offloaded blocks, slots, offsets, runs)
    chunk_graphs = policy.retrieval_k > 0 and fwd.options.chunk_indexes
    futures: dict[str, Future] = {}
    clock = _Clock(off.seconds)
    try:
        for layer, table in enumerate(seq.layer_tables):
            clock.lap(None)
            if id(table) not in split:
                ids = table.block_ids.long()
                gpos = table.offsets.long()[:, None] + pool.slot_pos[ids].long()               # [E, BS]
                shown = ((table.masks.long()[:, None] >> bits) & 1).bool()
                keep = shown & ((gpos < policy.sink_tokens) | (gpos >= prompt - policy.window_tokens))
                static = keep.any(1)
                rows, slots = (shown & ~static[:, None]).nonzero(as_tuple=True)
                runs: list[tuple[str, int]] = []
                if chunk_graphs:
                    order, runs = _chunk_runs(seq, table, gpos[rows, slots].cpu().numpy())
                    order = torch.as_tensor(order, device=rows.device)
                    rows, slots = rows[order], slots[order]
                split[id(table)] = (static.nonzero().squeeze(1).cpu().numpy(), ids[rows], slots,
                                    table.offsets.long()[rows], runs)
                clock.lap("split")
            static, blocks, slots, offsets, runs = split[id(table)]
            off.static.append(len(static))
            off.offloaded.append(int(blocks.shape[0]))
            if not policy.retrieval_k:
                continue          # the static set alone: nothing to index
            for key, _ in runs:
                if key not in futures:
                    try:
                        futures[key] = chunk_index(fwd, key, seq)
                    except Exception as exc:     # e.g. no KV blocks left for its query pass: the builder falls back
                        futures[key] = Future()
                        futures[key].set_exception(exc)
            clock.lap("chunks")
            # the request's queries index the keys outside whole chunks and link the chunks' graphs to one another
            # (IndexSet.add); without them, only chunks' graphs alone (a hand-off made without its queries)
            q = None if seq.prefill_queries is None else seq.prefill_queries.queries(layer)
            if q is not None:
                # [Hkv, M, D] on the device too: the copy thread ranks the keys for them there (``exact_lists``)
                train_dev = by_kv_head(q, hkv)
                train = train_dev.cpu().numpy()
            elif sum(n for _, n in runs) == blocks.shape[0]:
                train_dev, train = None, np.zeros((hkv, 0, fwd.cfg.head_dim), np.float32)
            else:
                raise ValueError(f"decode='retrieval' needs the prefill pass's queries to index layer {layer}: "
                                 "a hand-off must be made with them (prefill_handoff(tap_queries=True))")
            clock.lap("queries")
            layers.append((blocks, slots, offsets, train, train_dev, [(key, futures[key]) for key, _ in runs]))
    except BaseException:
        if fwd.indexes is not None:
            fwd.indexes.drop(owner)
        raise
    static = {key: entries for key, (entries, *_) in split.items()}
    seq.offload = off
    seq.prefill_queries = None   # the index holds what it needs
    if not policy.retrieval_k:
        off.build, off.finished = Future(), True
        off.build.set_result(None)
        off.copied.set()
        keep_static(fwd, seq, static)
        return
    # the K/V go to the host on a thread of their own, not the engine's (at 128K tokens that took ~29 s of it), the
    # sequence's blocks held until they are copied (then ``settle`` cuts its tables); the builder thread builds each
    # layer as soon as it is copied (``copied_layers``), beside the copy of the next
    after = torch.cuda.Event() if fwd.device.type == "cuda" else None
    if after is not None:
        after.record()                     # what the engine's stream has queued: the pass that wrote the K/V
    off.cut = lambda: keep_static(fwd, seq, static)
    copied_layers: queue.SimpleQueue = queue.SimpleQueue()
    copy = _copier(fwd).submit(_copy, fwd, off, layers, after, copied_layers)
    off.build = _builder(fwd).submit(_build, fwd.indexes, off, copy, copied_layers)


def index_set(fwd):
    """The engine's index set (services/index/heads.py IndexSet), made with its first retrieval sequence."""
    if fwd.indexes is None:
        from services.index.heads import IndexSet   # numba and faiss load with the first retrieval sequence

        fwd.indexes = IndexSet(threads=fwd.options.index_threads, host_dtype=fwd.options.index_host_dtype)
    return fwd.indexes


def holds(fwd, policy: RetrievalDecode) -> bool:
    """Whether a sequence's copied layers are held to be scanned while their indexes build (so it steps before they
    are built): ``EngineOptions.decode_while_building``, an index set that can (``IndexSet.hold``: not the index
    service's client yet), and keys to retrieve."""
    return bool(policy.retrieval_k and fwd.options.decode_while_building and hasattr(fwd.indexes, "hold"))


def new_owner() -> str:
    """A retrieval sequence's name in the index set, unique in the process."""
    return f"seq{next(_owners)}"


# NOTE: the scores of one query block against a KV head's keys are at most this many elements (1 GiB of fp32)
LIST_BLOCK_ELEMENTS = 1 << 28


def exact_lists(keys: torch.Tensor, queries: torch.Tensor) -> np.ndarray:
    """Each training query's exact top keys by inner product, best first, ranked on the keys' device: keys [Hkv, N, D]
    (any float dtype), queries [Hkv, M, D] (on any device) -> int32 [Hkv, M, P] on the host, P the index build's
    ``query_neighbors`` (at most N). What the builds and a composition's repair would otherwise search on the host's
    cores with faiss: at 130K keys a KV head, 256 queries took 1.6 s of one core a head and layer (8,192 of a request's
    queries, ~32x that), a few milliseconds on the GPU that holds the keys. Ties may rank in another order."""
    from services.index.build import BuildConfig

    hkv, n, _ = keys.shape
    p = min(BuildConfig().query_neighbors, n)
    out = torch.empty((hkv, queries.shape[1], p), dtype=torch.int32, device=keys.device)
    block = max(1, LIST_BLOCK_ELEMENTS // n)
    for h in range(hkv):
        kf = keys[h].float()
        for lo in range(0, queries.shape[1], block):
            q = queries[h, lo:lo + block].to(keys.device, torch.float32)     # (a hand-off's are on the host)
            out[h, lo:lo + block] = (q @ kf.T).topk(p, dim=1).indices.int()
    return out.cpu().numpy()


def _copier(fwd) -> ThreadPoolExecutor:
    """The engine's one thread copying offloaded K/V to the host (``_copy``), in the order sequences start."""
    if fwd.index_copier is None:
        fwd.index_copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="index-copy")
    return fwd.index_copier


def _copy(fwd, off: Offload, layers: list, after, copied_layers: queue.SimpleQueue) -> None:
    """The copy thread: each layer's offloaded keys (rotated to their global positions, as the attention kernels do)
    and values, [Hkv, N, D] on the host in the dtype the index set holds them (float32, or bfloat16 rounded on the
    device: ``IndexSet.host_dtype``), and each training query's exact top keys among them (``exact_lists``: ranked
    where the keys are, not by the index builds on the host), on the copy stream of the GPU, which starts after
    ``after`` (the engine's stream when the sequence started); stops early when the sequence is released. Puts each
    layer for the builder on ``copied_layers`` as it is copied (keys, values, training queries, chunk runs, exact
    lists or None), then None however it ends; ``off.copied`` is set however it ends."""
    pool, model = fwd.pool, fwd.model
    held = held_dtype(fwd)
    t0 = time.perf_counter()
    stream = None if after is None else copy_stream(fwd.device)
    try:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if stream is not None:
                stream.wait_event(after)
            staging = HostStaging()
            for layer, (blocks, slots, offsets, train, train_dev, runs) in enumerate(layers):
                if off.cancelled:
                    break
                cos, sin = rope_cos_sin(offsets, model.inv_freq)
                k = rotate(pool.k[layer][blocks, slots].float(), cos[:, None, :], sin[:, None, :])
                item = host_layer(k, pool.v[layer][blocks, slots], train, train_dev, runs, held, staging)
                hold(fwd, off, layer, item)
                copied_layers.put(item)
                layers[layer] = item = None        # (the copies waited for this stream: nothing of it is in flight)
            else:
                if off.holds:
                    off.held.set()        # every layer held: the sequence may step (before ``copied``: ``wait``)
    finally:
        off.seconds["keys"] = time.perf_counter() - t0
        off.copied.set()
        copied_layers.put(None)


def hold(fwd, off: Offload, layer: int, item: tuple) -> None:
    """The copy thread: a copied layer's K/V (``host_layer``'s item) held in the index set to be scanned until the
    builder indexes it, where the sequence ``holds`` (``EngineOptions.decode_while_building``)."""
    if off.holds:
        fwd.indexes.hold(off.owner, layer, item[0], item[1])


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The copy thread's CUDA stream on ``device`` (one a GPU, made at first use)."""
    return COPY_STREAMS.get(device) or COPY_STREAMS.setdefault(device, torch.cuda.Stream(device))


def held_dtype(fwd) -> torch.dtype:
    """The torch dtype the engine's index set holds offloaded K/V in (``IndexSet.host_dtype``)."""
    return torch.bfloat16 if fwd.indexes.host_dtype == "bfloat16" else torch.float32


def by_kv_head(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """Queries [M, Hq, D] as float32 [Hkv, M * g, D]: each KV head's g query heads stacked, head by head (how the index
    set takes a layer's training queries)."""
    m, hq, d = q.shape
    return q.float().reshape(m, hkv, hq // hkv, d).permute(1, 0, 2, 3).reshape(hkv, -1, d)


def host_layer(k: torch.Tensor, v: torch.Tensor, train: np.ndarray, train_dev: torch.Tensor | None, runs: list,
               held: torch.dtype, staging: "HostStaging") -> tuple:
    """What the builder takes of one layer (``_build``): its offloaded keys (at their global positions) and values,
    [N, Hkv, D] on the device, to the host as [Hkv, N, D] in ``held`` (the index set's dtype), beside the training
    queries (host ``train``, device ``train_dev`` [Hkv, M, D] or None), the chunk runs, and each training query's
    exact top keys (``exact_lists``, ranked on the device; None without queries or keys). On the current stream,
    which the host copies wait for."""
    k = k.to(held).permute(1, 0, 2)
    v = v.to(held).permute(1, 0, 2)
    ranked = train_dev is not None and train_dev.shape[1] and k.shape[1]
    lists = exact_lists(k, train_dev) if ranked else None
    return staging.to_host(k), staging.to_host(v), train, runs, lists


# NOTE: threads that copy a staged layer into its host array (bench/decode/host_copy.py): the host copy, not the
# pinned one, is the cost (a fresh array's first touch a page at a time: 1.86 GB/s on one thread of an H200 host,
# against 54.1 GB/s device to pinned)
HOST_COPY_THREADS = 8
HOST_COPY_PIECE = 1 << 24      # elements a piece (64 MiB of fp32)


def host_array(shape: tuple[int, ...], dtype, populate: bool = True) -> np.ndarray:
    """A zeroed, writable, C-contiguous host array whose pages are mapped now (``populate``: an anonymous mapping
    made with MAP_POPULATE, where the system has it), not at their first touch, a fault a page: filling a fresh 256
    MiB array so ran 2.77 GB/s against 0.95 for ``np.empty`` on one thread of this repository's 2-core machine, 2.86
    against 1.41 on two (bench/decode/README.md; not yet measured on a GPU host). Its memory goes back when the array
    (and every view of it) is gone. ``populate`` False, an empty array, or no MAP_POPULATE: ``np.zeros``' array (its
    pages mapped at first touch)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    flag = getattr(mmap, "MAP_POPULATE", None)
    if not populate or nbytes == 0 or flag is None:
        return np.zeros(shape, dtype)
    mapped = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | flag)
    return np.frombuffer(mapped, dtype=dtype).reshape(shape)


class HostStaging:
    """Device tensors to C-contiguous host arrays through one pinned buffer, grown as needed and used again: the
    device-to-host copy at the pinned rate, then a host copy into pageable memory, in pieces on ``threads`` threads
    (numpy's copy lets go of the interpreter), into arrays whose pages are mapped beforehand (``host_array``;
    ``populate`` False: at their first touch, by the copy). (``tensor.cpu()`` of a permuted fp32 layer took 28.98 s
    for the 34 GB of a 128K context's K/V on an H200 host, 1.18 GB/s, and left the arrays strided for the builder to
    copy again.) Waits for the current stream; on the CPU, no staging."""

    def __init__(self, threads: int = HOST_COPY_THREADS, populate: bool = True) -> None:
        self._buffer: torch.Tensor | None = None
        self.threads = max(1, threads)
        self.populate = populate

    def to_host(self, t: torch.Tensor) -> np.ndarray:
        """``t`` on the host, C-contiguous; a bfloat16 tensor as its bits (uint16: services/index/half.py)."""
        if t.device.type != "cuda":
            return np.ascontiguousarray(_numpy(t.detach()))
        t = t.contiguous()
        n = t.numel()
        if self._buffer is None or self._buffer.numel() < n or self._buffer.dtype != t.dtype:
            self._buffer = torch.empty(n, dtype=t.dtype, pin_memory=True)
        part = self._buffer[:n]
        part.copy_(t.view(-1), non_blocking=True)
        torch.cuda.current_stream(t.device).synchronize()
        src = _numpy(part)
        out = host_array(tuple(t.shape), src.dtype, self.populate)
        copy_pieces(out.reshape(-1), src, self.threads)
        return out


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A host tensor's numpy view; bfloat16, which numpy lacks, as its bits (uint16)."""
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def copy_pieces(dst: np.ndarray, src: np.ndarray, threads: int, piece: int = HOST_COPY_PIECE) -> None:
    """``dst[:] = src`` (1-D, one length), in pieces of ``piece`` elements on up to ``threads`` threads."""
    cuts = list(range(0, src.shape[0], piece)) + [src.shape[0]]
    if threads <= 1 or len(cuts) <= 2:
        np.copyto(dst, src)
        return
    with ThreadPoolExecutor(max_workers=min(threads, len(cuts) - 1)) as pool:
        list(pool.map(lambda i: np.copyto(dst[cuts[i]:cuts[i + 1]], src[cuts[i]:cuts[i + 1]]), range(len(cuts) - 1)))


def settle(seq) -> None:
    """On the engine thread: once the copy thread is done with a retrieval sequence's blocks, cut its tables to the
    static set (``keep_static``: the private blocks no layer keeps freed, the chunks no layer reads unpinned)."""
    off = seq.offload
    if off is not None and off.cut is not None and off.copied.is_set() and not seq.released:
        cut, off.cut = off.cut, None
        cut()


class _Clock:
    """Seconds between laps, summed by name into ``into`` (a lap named None starts the next one only)."""

    def __init__(self, into: dict[str, float]):
        self.into, self.t = into, time.perf_counter()

    def lap(self, name: str | None) -> None:
        now = time.perf_counter()
        if name is not None:
            self.into[name] = self.into.get(name, 0.0) + now - self.t
        self.t = now


def _builder(fwd) -> ThreadPoolExecutor:
    """The engine's one index-building thread: builds run in the order they were asked for, so a sequence's build
    finds the chunk indexes asked for before it done."""
    if fwd.index_builder is None:
        fwd.index_builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="index-build")
    return fwd.index_builder


def _chunk_runs(seq, table, gpos: np.ndarray) -> tuple[np.ndarray, list[tuple[str, int]]]:
    """The offloaded tokens of a table (their global positions ``gpos`` [N], unique) reordered so that every shared
    chunk placed wholly among them comes first, as a run in its own token order: (order [N], runs [(chunk id,
    length)]). Each position is offloaded once whichever block shows it, so a run holds the chunk's cached keys and
    CacheBlend's recomputed ones alike. Chunks touching the static set, and the rest, follow, in their order."""
    by_pos = np.argsort(gpos, kind="stable")
    pos = gpos[by_pos]
    block_ids, offsets = table.block_ids.cpu().numpy(), table.offsets.cpu().numpy()
    found, starts = [], set()
    for entry in seq.pinned:
        if entry.kind != "chunk" or entry.key not in seq.chunk_tokens:
            continue
        # a chunk placed twice shows its one set of blocks at both starts (and may be pinned once a placement): a run
        # a start
        for start in np.unique(offsets[np.isin(block_ids, entry.blocks)]).tolist():
            if start in starts:
                continue
            starts.add(start)
            lo, hi = np.searchsorted(pos, [start, start + entry.length])
            if hi - lo == entry.length:        # unique positions: the run is the whole chunk
                found.append((start, entry.key, by_pos[lo:hi]))
    found.sort(key=lambda f: f[0])
    taken = np.zeros(gpos.shape[0], bool)
    for _, _, idx in found:
        taken[idx] = True
    order = np.concatenate([idx for _, _, idx in found] + [np.nonzero(~taken)[0]]).astype(np.int64)
    return order, [(key, idx.shape[0]) for _, key, idx in found]


def chunk_index(fwd, key: str, seq) -> Future:
    """The index of shared chunk ``key`` (a ``ChunkIndex``): one held (``fwd.chunk_indexes``), one being built, one
    the store holds (``fwd.chunk_index_store``: its bytes checked, and its shape against the chunk's), or one whose
    build starts now: the chunk alone runs again to tap its queries, and its keys (as cached) and those queries go to
    the builder thread, which then stores it."""
    from services.index.chunks import ChunkIndexCache

    if fwd.chunk_indexes is None:
        fwd.chunk_indexes = ChunkIndexCache(fwd.options.chunk_index_bytes)
    entry = next(e for e in seq.pinned if e.key == key)
    built = fwd.chunk_indexes.get(key)
    if built is None:
        built = _stored_chunk_index(fwd, key, entry.length)
    if built is not None:
        done: Future = Future()
        done.set_result(built)
        return done
    pending = fwd.chunk_builds.get(key)
    if pending is not None:
        return pending
    keys, train = chunk_inputs(fwd, seq.chunk_tokens[key], entry)
    fut = _builder(fwd).submit(_build_chunk, fwd, key, keys, train)
    fwd.chunk_builds[key] = fut
    return fut


def _stored_chunk_index(fwd, key: str, length: int):
    """The store's copy of a chunk's index, kept in ``fwd.chunk_indexes``; None when there is no store, it holds
    none, or its bytes are not an intact index of this chunk and model (``adopt_chunk_index``). A decode worker
    fetches it before admission (services/handoff/prepare.py), so this round trip is the engine thread's only when
    that did not."""
    store = fwd.chunk_index_store
    blob = None if store is None else store.get(key)
    return None if blob is None else adopt_chunk_index(fwd, key, length, blob)


def adopt_chunk_index(fwd, key: str, length: int, blob: bytes):
    """A chunk index from its stored bytes, kept in ``fwd.chunk_indexes``; None when the bytes are not an intact index
    of this chunk (``length`` tokens) and model: refused, counted and logged, the store's copy dropped so that the
    index built again takes its place."""
    from services.index.chunks import ChunkIndex, ChunkIndexCache

    cfg = fwd.cfg
    try:
        index = ChunkIndex.from_bytes(blob)
        if (index.length, index.num_layers, index.num_heads) != (length, cfg.num_layers, cfg.num_kv_heads):
            raise ValueError(f"it has {index.length} keys x {index.num_layers} layers x {index.num_heads} heads, the "
                             f"chunk {length} x {cfg.num_layers} x {cfg.num_kv_heads}")
    except ValueError as exc:
        log.warning("the stored index of chunk %s is refused, and built again: %s", key[:16], exc)
        fwd.chunk_index_refused += 1
        if fwd.chunk_index_store is not None:
            fwd.chunk_index_store.drop(key)          # so that the rebuilt one takes its place
        return None
    if fwd.chunk_indexes is None:
        fwd.chunk_indexes = ChunkIndexCache(fwd.options.chunk_index_bytes)
    fwd.chunk_indexes.put(key, index)
    return index


def chunk_inputs(fwd, tokens, entry) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A resident chunk's keys in its frame, [Hkv, L, D] a layer, and its queries, [Hkv, M, D] a layer (M <=
    ``CHUNK_TRAIN_QUERIES``): its own, from running it alone, each rotated forward by one of ``CHUNK_QUERY_SHIFTS``
    (in turn), as the queries of a later position would be. Both on the host, fp16."""
    from services.index.chunks import CHUNK_TRAIN_QUERIES

    cfg, pool = fwd.cfg, fwd.pool
    hkv, g = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    tap = QueryTap(cap=max(1, CHUNK_TRAIN_QUERIES // g))
    fwd.tap_chunk(list(tokens), tap)
    block, slot = pool.slots_for(entry.blocks, entry.length)
    shifts = torch.tensor([int(f * cfg.max_position_embeddings) for f in CHUNK_QUERY_SHIFTS], device=fwd.device)
    keys, train = [], []
    for layer in range(cfg.num_layers):
        keys.append(pool.k[layer][block, slot].permute(1, 0, 2).to("cpu", torch.float16))
        q = tap.queries(layer)
        cos, sin = rope_cos_sin(shifts[torch.arange(q.shape[0], device=fwd.device) % shifts.shape[0]],
                                fwd.model.inv_freq)
        q = rotate(q.float(), cos[:, None, :], sin[:, None, :])
        train.append(by_kv_head(q, hkv).to("cpu", torch.float16))
    return keys, train


def _build_chunk(fwd, key: str, keys: list, train: list):
    """The builder thread: a chunk's index, kept in the engine's chunk-index cache."""
    from services.index.chunks import ChunkIndex

    try:
        index = ChunkIndex.build([k.float().numpy() for k in keys], [q.float().numpy() for q in train],
                                 threads=fwd.options.index_threads)
        fwd.chunk_indexes.put(key, index)
        if fwd.chunk_index_store is not None:
            fwd.chunk_index_store.put(key, index.to_bytes())
        return index
    finally:
        fwd.chunk_builds.pop(key, None)


def _build(indexes, off: Offload, copy: Future, copied_layers: queue.SimpleQueue) -> None:
    """The builder thread: each layer's K/V and indexes into the index set (composed with the graphs of its chunks)
    as soon as the copy thread has put the layer on ``copied_layers``, unless the sequence is released first (what
    was added is then dropped); then the copy's own error, if it failed."""
    try:
        for layer in itertools.count():
            item = copied_layers.get()
            if item is None or off.cancelled:
                break
            keys, values, train, runs, lists = item
            try:
                chunks = [(key, fut.result()) for key, fut in runs]   # built before this job: none waits
            except Exception as exc:
                if not train.shape[1]:
                    raise
                # a chunk's index could not be had: this layer's index is the sequence's own, over every key
                log.warning("a chunk index failed (%s): layer %d of %s is indexed whole", exc, layer, off.owner)
                chunks = []
            indexes.add(off.owner, layer, keys, values, train, chunks, lists)
            item = None                     # the index set holds them now
        copy.result()                       # a failed copy fails the sequence (its layers are dropped on release)
    finally:
        with off.lock:
            off.finished = True
            if off.cancelled:
                indexes.drop(off.owner)


def keep_static(fwd, seq, static: dict[int, np.ndarray]) -> None:
    """Cut each layer's table to its static entries (``static``: per distinct table object, the entry indices kept),
    free the private blocks no layer keeps and unpin the chunks no layer reads."""
    cut: dict[int, BlockTable] = {}
    for table in seq.layer_tables:
        if id(table) in cut:
            continue
        keep = static[id(table)]
        idx = torch.as_tensor(keep, dtype=torch.long, device=table.block_ids.device)
        cut[id(table)] = BlockTable(table.block_ids[idx], table.offsets[idx], table.masks[idx], table.max_offset, None,
                                    None if table.id_rows is None else table.id_rows[:, idx],
                                    None if table.host_rows is None else table.host_rows[:, keep])
    seq.layer_tables = [cut[id(t)] for t in seq.layer_tables]
    kept = {int(b) for t in cut.values() for b in t.block_ids.tolist()}
    unused = [b for b in seq.private_blocks if b not in kept]
    fwd.pool.free(unused)
    seq.private_blocks = [b for b in seq.private_blocks if b in kept]
    for entry in [e for e in seq.pinned if not kept.intersection(e.blocks)]:
        seq.pinned.remove(entry)
        fwd.cache.release(entry)


class RetrievalStep(PolicyStep):
    """One decode step of a group of retrieval sequences."""

    def __init__(self, policy: RetrievalDecode, fwd, seqs):
        super().__init__(policy, fwd, seqs)
        for s in seqs:            # a sequence not ready (``RetrievalDecode.ready``) is waited for (its error raised)
            s.offload.wait()
            settle(s)
        n = len(seqs)
        self.scanned = np.zeros(n, np.int64)
        self.seconds = 0.0
        self.static_read = [0] * n
        self.visible = [s.decode_stats.visible(s, fwd.cfg.num_layers, fwd.cfg.num_kv_heads) for s in seqs]
        self.owners = [s.offload.owner for s in seqs]
        self._selections: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}   # by the rows' entry counts
        self._buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None     # ``_host``
        self._copied = None       # the event recorded after a layer's query copy (on a GPU)

    def _selection(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every entry of each row at ``layer`` (its static table's, then its generated blocks), as the sparse
        attention's sel [B, Hkv, K] int32 and count [B, Hkv] int32 (which also gives the log-sum-exp the merge
        needs). Made once a step for the layers whose tables hold as many entries (most share one table), and sent
        in one asynchronous copy."""
        hkv = self.fwd.cfg.num_kv_heads
        lengths = tuple(s.layer_tables[layer].num_entries + len(s.gen_blocks) for s in self.seqs)
        for i, n in enumerate(lengths):
            self.static_read[i] += hkv * n
        made = self._selections.get(lengths)
        if made is None:
            rows, width = len(lengths), max(1, max(lengths))
            host = np.full(rows * hkv * (width + 1), -1, np.int32)         # sel [B, Hkv, K], then count [B, Hkv]
            sel, count = host[:rows * hkv * width].reshape(rows, hkv, width), host[rows * hkv * width:]
            base = 0
            for i, n in enumerate(lengths):   # global entry indices: each row's entries follow the rows before it
                sel[i, :, :n] = np.arange(base, base + n)
                count[i * hkv:(i + 1) * hkv] = n
                base += n
            both = host_to_device(host, torch.int32, self.fwd.device)
            made = self._selections[lengths] = (both[:rows * hkv * width].view(rows, hkv, width),
                                                both[rows * hkv * width:].view(rows, hkv))
        return made

    def attend(self, layer, q, table, cu_entries):
        fwd, model, pool = self.fwd, self.fwd.model, self.fwd.pool
        sel, count = self._selection(layer)
        static = (q, pool.k[layer], pool.v[layer], table.block_ids, table.offsets, table.masks, sel, count,
                  model.inv_freq, model.scale)
        if not self.policy.retrieval_k:        # the static set alone: nothing goes to the host
            return sparse.sparse_decode_attention(*static, backend=fwd.backend)[0]
        on_gpu = q.device.type == "cuda"
        q_host, out_host, lse_host = self._host(q)
        # the queries to the host first (a pinned copy on the stream: waiting for it waits for nothing after it)
        q_host.copy_(q, non_blocking=on_gpu)
        if on_gpu:
            self._copied.record()
        # the static set's attention, its parts unmerged, the last left for the retrieved keys' partial result
        outs, lses = sparse.sparse_decode_parts(*static, spare=1, backend=fwd.backend)
        if on_gpu:
            self._copied.synchronize()
        ans = fwd.indexes.attend(layer, self.owners, q_host.numpy(), self.policy.retrieval_k, model.scale)
        self.scanned += ans.scanned
        self.seconds += ans.seconds
        np.copyto(out_host.numpy(), ans.out)
        np.copyto(lse_host.numpy(), ans.lse)
        outs[-1].copy_(out_host, non_blocking=on_gpu)
        lses[-1].copy_(lse_host, non_blocking=on_gpu)
        return merge_attention(outs, lses, backend=fwd.backend, out_dtype=q.dtype)[0]

    def _host(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's host buffers (pinned on a GPU), made at its first layer and used at every one: the queries
        [B, Hq, D], the retrieved keys' out [B, Hq, D] and lse [B, Hq], fp32. Reuse is safe on the one stream: a
        layer writes them only after its query copy is waited for, which follows the last layer's copies to the GPU."""
        if self._buffers is None or self._buffers[0].shape != q.shape:
            b, hq, d = q.shape
            pinned = q.device.type == "cuda"
            flat = torch.empty(b * hq * (2 * d + 1), dtype=torch.float32, pin_memory=pinned)
            self._buffers = (flat[:b * hq * d].view(b, hq, d), flat[b * hq * d:2 * b * hq * d].view(b, hq, d),
                             flat[2 * b * hq * d:].view(b, hq))
            self._copied = torch.cuda.Event() if pinned else None
        return self._buffers

    def end(self) -> None:
        for s, visible, read, scanned in zip(self.seqs, self.visible, self.static_read, self.scanned.tolist()):
            s.decode_stats.add(visible, read)
            s.decode_stats.keys_scanned += scanned
        if self.seqs:   # the step's retrieval time, counted once per sequence of the group
            for s in self.seqs:
                s.decode_stats.retrieval_seconds += self.seconds
