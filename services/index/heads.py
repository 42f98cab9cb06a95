"""Offloaded K/V and their indexes, and RetrievalAttention's CPU half: attention over the keys retrieved for a query.

What a retrieval decode keeps off the GPU, per (owner, layer, KV head): the keys [N, D], rotated in one frame (a
sequence's own: its global positions), the values [N, D], both float32 or both bfloat16 (``IndexSet(host_dtype=)``,
``half.py``), and an ``AttentionIndex`` over the keys built from
training queries in the same frame. At every decode step and layer, the query heads of a KV head's group search its
index together for each one's top-k keys by inner product (one traversal that reads each key once for the group,
``AttentionIndex.attend_group``; ``IndexSet(group_search=False)``: a search a query head); the attention over those
keys alone is returned as a partial result, the output (softmax-weighted values, [D]) and its log-sum-exp, which the
caller merges with the GPU's partial result over the static set (kernels/lse_merge). Scores are scaled logits,
q·k·scale, as the GPU kernels compute them, so that the two log-sum-exps are in the same units.

``IndexSet`` serves many owners at once and searches the (row, KV head) pairs of one call in parallel: in one compiled
call on numba's threads (``_layer``) where it applies, else on a thread pool (the index's search releases the GIL).
The retrieval-index service (server.py) serves the same object over gRPC; the engine's in-process decode path calls
it directly.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from services.index import _layer, half
from services.index.build import BuildConfig
from services.index.chunks import ChunkIndex
from services.index.graph import AttentionIndex


# NOTE: a head whose graph search read at least this share of its keys (for a query group) is scanned whole instead
# for its next SCAN_CALLS searches, then searched by its graph once more to see whether that still holds: a scan reads
# keys in order, ~2.5x cheaper a key than a graph search's reads at random on one core (services/index/_scan.py), so
# past about a third of the keys the scan costs no more, and it finds the exact top keys (up to the codes' rounding)
SCAN_SHARE = 0.3
SCAN_CALLS = 64
# a held head's scan count (``IndexSet.hold``): scanned at every call until its index replaces it
HELD_SCANS = 1 << 62

# NOTE: batches of several rows whose compiled calls' nested lists are kept (``IndexSet._nested``): 8 batches of a
# 32-layer model; a batch's entries are remade (~0.1 ms a row) when it comes back after others pushed it out
NESTED_KEPT = 256

# NOTE: a composition's repair with the request's queries, one round: on the longgen model's Q/K (bench/index/README.md)
# one round gave recall@100 0.910 at 20% of the keys scored in 0.38 s a head, two 0.923 in 0.87 s; the repair is what
# a request reusing its chunks' indexes waits for before its first step
COMPOSED = BuildConfig(repair_rounds=1)


@dataclass(frozen=True, slots=True)
class HeadKV:
    """One (owner, layer, KV head): values [N, D] (N >= 1; float32 or bfloat16 bits) and the index over the keys (which
    holds them, in the same dtype)."""

    values: np.ndarray
    index: AttentionIndex

    @property
    def keys(self) -> np.ndarray:
        return self.index.keys

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    @property
    def index_bytes(self) -> int:
        """The graph's bytes and the int8 keys its searches traverse (the exact keys counted once, in ``nbytes``)."""
        return self.index.nbytes - self.keys.nbytes


def partial_attention(head: HeadKV, queries: np.ndarray, k: int, scale: float, beam: int | None = None,
                      group_search: bool = True, scan: bool = False) -> tuple[np.ndarray, np.ndarray, int]:
    """queries float32 [G, D] (the query heads sharing this KV head, rotated in the keys' frame) -> attention over each
    one's top-k retrieved keys: out float32 [G, D], lse float32 [G] (natural log of the summed exp of the scaled
    logits), and the keys the search read. One compiled call: the G heads in one traversal, each key read once for them
    (``AttentionIndex.attend_group``), or with ``group_search=False`` a search a head (``attend``; the keys read summed
    over the heads). ``scan``: every key scored instead (``attend_group(scan=True)``; the keys read: all of them)."""
    if group_search or scan:
        out, lse, scanned = head.index.attend_group(queries[None], head.values, k, scale, beam=beam, scan=scan)
        return out[0], lse[0], int(scanned[0])
    out, lse, scanned = head.index.attend(queries, head.values, k, scale, beam=beam)
    return out, lse, int(scanned.sum())


def layers_beam(rows, k: int, beam: int | None) -> int:
    """The beam a call's searches use (``AttentionIndex._beam``'s rule: ``beam``, or at least ``DEFAULT_BEAM``)."""
    head = next(h for heads in rows for h in heads if h is not None)
    return head.index._beam(k, beam)[1]


@dataclass(frozen=True, slots=True)
class Answer:
    """One search call's reply: out float32 [B, Hq, D] and lse float32 [B, Hq] (-inf and 0 where a row's owner has no
    offloaded key at that layer), scanned int64 [B] (keys read for each row, over its searches), seconds (wall time)."""

    out: np.ndarray
    lse: np.ndarray
    scanned: np.ndarray
    seconds: float


class IndexSet:
    """Offloaded K/V and indexes of many owners (a sequence, later a chunk), by (owner, layer, KV head).

    ``threads``: searches run at once in one call (the service's cores). ``compiled``: a call's searches in one
    compiled call on numba's threads where they allow it (``_layer``: 2.5x less wall a layer on a 16-core host), once
    it is compiled in the process (the first ``add`` starts that); else, and until then, on a thread pool.
    ``repair_queries``: at most this many of a head's training queries repair a composition of chunk graphs (default ``COMPOSED``'s: all of a request's 8,192 a
    KV head of an 8B-shaped model). The repair is most of the wait before a retrieval sequence's first step, and its
    cost grows with them; fewer give lower recall (bench/index/README.md: 2,048 of 3,598 cost 1.2 points of recall at
    20% scanned for 0.56x the repair's time). ``group_search``: a KV head's query heads searched in one traversal
    (default; bench/index/README.md: the same recall for fewer keys read a query head) or one search a head.
    ``host_dtype``: how the offloaded keys and values are held (``half.DTYPES``): float32, or bfloat16 for half the
    bytes (512K tokens of an 8B-shaped model: 69 GB against 137), the values exactly as a bfloat16 pool holds them and
    the keys rounded once more after their rotation."""

    def __init__(self, threads: int = 4, repair_queries: int | None = None, group_search: bool = True,
                 scan_share: float | None = SCAN_SHARE, compiled: bool = True, host_dtype: str = half.FLOAT32):
        self.host_dtype = half.check_dtype("host_dtype", host_dtype)
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        if repair_queries is not None and (isinstance(repair_queries, bool) or not isinstance(repair_queries, int)
                                           or repair_queries < 1):
            raise ValueError(f"repair_queries must be an int >= 1, got {repair_queries!r}")
        self.threads = threads
        if scan_share is not None and not 0 < scan_share <= 1:
            raise ValueError(f"scan_share must be in (0, 1] or None, got {scan_share!r}")
        self.group_search = bool(group_search)
        self.compiled = bool(compiled)
        self.scan_share = scan_share
        # (owner, layer, KV head) -> searches left that scan every key instead of the graph (SCAN_SHARE)
        self._scans: dict[tuple[str, int, int], int] = {}
        self.composed = COMPOSED if repair_queries is None else replace(COMPOSED, repair_queries=repair_queries)
        self._heads: dict[tuple[str, int], list[HeadKV | None]] = {}
        self._holding: set[tuple[str, int]] = set()     # (owner, layer) held by ``hold`` and not indexed since
        self._layer_arrays: dict[tuple[str, int], _layer.LayerArrays] = {}      # what ``_layer.attend`` takes
        # (owners, layer) of a batch of several rows -> the LayerArrays its nested lists were made of, and those lists
        # (``_layer.nested``): a decode batch calls with the same rows at every layer of every step. At most
        # NESTED_KEPT, the oldest dropped first; an owner's entries go when it is added again or dropped (the lists
        # hold its arrays)
        self._nested: OrderedDict[tuple[tuple[str, ...], int], tuple[tuple, tuple]] = OrderedDict()
        self._calls = {"compiled": 0, "pool": 0}        # search calls answered by each path (``calls_by_path``)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="index-search")

    def add(self, owner: str, layer: int, keys: np.ndarray, values: np.ndarray, train_queries: np.ndarray,
            chunks: Sequence[tuple[str, ChunkIndex]] = (), lists: np.ndarray | None = None) -> int:
        """keys, values float32 [Hkv, N, D], or bfloat16 bits (uint16: ``half.py``), held as ``host_dtype``;
        train_queries float32 [Hkv, M, D] (queries in the keys' frame, per the KV head they read). N may be 0 (nothing
        offloaded at this layer: searches of it return nothing). ``chunks``: (chunk id, its ``ChunkIndex``) of the
        shared chunks whose keys come first, whole and in order; the keys after them get a graph built here from
        ``train_queries`` (M may be 0 when the chunks cover every key), and each head's index composes the chunks'
        graphs at this layer with it (``AttentionIndex.compose``). Replaces what the owner had at that layer; returns
        the indexes' bytes. ``lists``: int [Hkv, M, >= P], each training query's exact top keys among all N by inner
        product, best first, computed where the keys were (the GPU), so that neither the build nor a composition's
        repair searches them here (``build.given_lists``)."""
        keys, values = self._kv(keys, values)
        train = np.ascontiguousarray(train_queries, np.float32)
        if train.ndim != 3 or train.shape[0] != keys.shape[0] or train.shape[2] != keys.shape[2]:
            raise ValueError(f"train_queries must be [Hkv, M, D] with Hkv, D = {keys.shape[0]}, {keys.shape[2]}, "
                             f"got {train.shape}")
        hkv, n = keys.shape[:2]
        if lists is not None and (np.ndim(lists) != 3 or np.shape(lists)[0] != hkv):
            raise ValueError(f"lists must be [Hkv, M, P] with Hkv = {hkv}, got shape {np.shape(lists)}")
        for cid, index in chunks:
            if index.num_heads != hkv or layer >= index.num_layers:
                raise ValueError(f"chunk index {cid[:16]} has {index.num_layers} layers x {index.num_heads} KV heads: "
                                 f"it has no graph for layer {layer} of {hkv} heads")
        parts = [index.graphs[layer] for _, index in chunks]
        covered = sum(index.length for _, index in chunks)
        if covered > n:
            raise ValueError(f"the parts cover {covered} keys, only {n} were given")
        if n == 0:
            heads: list[HeadKV | None] = [None] * hkv
        else:   # the KV heads' indexes build in parallel (their compiled loops release the GIL), the cores shared out
            each = max(1, self.threads // hkv)
            held = self.host_dtype

            with self._lock:
                prior = self._heads.get((owner, layer))
            codes = [None] * hkv         # the int8 codes of these keys, where ``hold`` made them already
            if prior is not None and len(prior) == hkv:
                for h, head in enumerate(prior):
                    if head is not None and head.index.num_edges == 0 and np.array_equal(
                            head.keys, half.stored(keys[h], held)):
                        codes[h] = head.index.compact

            def one(h: int) -> AttentionIndex:
                given = None if lists is None else lists[h]
                if not parts:
                    return AttentionIndex.build(keys[h], train[h], threads=each, key_dtype=held, lists=given,
                                                compact=codes[h])
                graphs = [p[h] for p in parts]
                if covered < n:
                    graphs.append(AttentionIndex.build(keys[h, covered:], train[h], threads=each,
                                                       key_dtype=held).graph)
                index = AttentionIndex.compose(keys[h], graphs, self.composed, key_dtype=held, compact=codes[h])
                if train.shape[1]:      # the request's queries link the parts (build.repair_graph)
                    index = index.repaired(train[h], threads=each, lists=given)
                return index

            heads = [HeadKV(values[h], index) for h, index in enumerate(self._pool.map(one, range(hkv)))]
        self._store(owner, layer, heads, scanned=False)
        return sum(h.index_bytes for h in heads if h is not None)

    def _store(self, owner: str, layer: int, heads: list, scanned: bool) -> None:
        """An owner's heads at ``layer`` (all None: no key there) in place of what it had, with the arrays of the
        compiled call; ``scanned``: each scanned whole at every search (``hold``'s), else searched by its graph (the
        replaced heads' scan counts say nothing of these)."""
        arrays = None
        if self.compiled and heads and all(h is not None for h in heads):
            arrays = _layer.LayerArrays([(h.index, h.values) for h in heads])
        with self._lock:
            self._heads[(owner, layer)] = heads
            if scanned:
                self._holding.add((owner, layer))
            else:
                self._holding.discard((owner, layer))
            self._forget_nested(owner)
            if arrays is None:
                self._layer_arrays.pop((owner, layer), None)
            else:
                self._layer_arrays[(owner, layer)] = arrays
            self._forget_scans(owner, layer)
            if scanned:
                for h, head in enumerate(heads):
                    if head is not None:
                        self._scans[(owner, layer, h)] = HELD_SCANS
        if arrays is not None:
            _layer.warming(self.host_dtype)    # compiled before the searches come, once these heads' loops are

    def _kv(self, keys, values) -> tuple[np.ndarray, np.ndarray]:
        """Keys (float32, or bfloat16 bits as given) and values (held as ``host_dtype``), both [Hkv, N, D]; ValueError
        otherwise."""
        keys, values = np.asarray(keys), half.stored(values, self.host_dtype)
        if keys.dtype != half.BITS:
            keys = np.ascontiguousarray(keys, np.float32)
        if keys.ndim != 3 or values.shape != keys.shape:
            raise ValueError(f"keys and values must both be [Hkv, N, D], got {keys.shape} and {values.shape}")
        return keys, values

    def hold(self, owner: str, layer: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Hold an owner's keys and values at ``layer`` (as ``add`` takes them) before their index is built: each head
        with no graph (``AttentionIndex.unlinked``), scanned whole at every search, which finds the exact top keys up
        to the int8 codes' beam (``_scan``), until ``add`` replaces it with its index. So a sequence can decode while
        its indexes build, each step reading every key of the layers not yet indexed. Replaces what the owner had at
        that layer."""
        keys, values = self._kv(keys, values)
        # held writable: numba compiles other specializations for read-only arrays (a service's views of the bytes
        # it received), which the warm-up does not, and a first search compiling them outlasts its deadline
        keys = keys if keys.flags.writeable else keys.copy()
        values = values if values.flags.writeable else values.copy()
        hkv, n = keys.shape[:2]
        held = self.host_dtype
        heads: list[HeadKV | None] = [None] * hkv if n == 0 else [
            HeadKV(values[h], index) for h, index in enumerate(
                self._pool.map(lambda h: AttentionIndex.unlinked(keys[h], key_dtype=held), range(hkv)))]
        self._store(owner, layer, heads, scanned=True)

    def held_kv(self, owner: str, layer: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The keys and values ``hold`` left at an owner's layer, [Hkv, N, D] each as held (float32, or bfloat16 bits),
        what ``add`` takes to index them; None where the layer is not held (never, or indexed since). Copies."""
        with self._lock:
            heads = self._heads.get((owner, layer)) if (owner, layer) in self._holding else None
        if not heads or any(h is None for h in heads):
            return None
        return np.stack([h.keys for h in heads]), np.stack([h.values for h in heads])

    def calls_by_path(self) -> dict[str, int]:
        """Search calls answered so far in one compiled call (``compiled``) and on the thread pool (``pool``): a
        process's first calls take the pool while the compiled call compiles."""
        with self._lock:
            return dict(self._calls)

    def has(self, owner: str, layer: int) -> bool:
        with self._lock:
            return (owner, layer) in self._heads

    def held(self) -> tuple[int, int, int]:
        """(owners, offloaded K/V bytes, index bytes) held now."""
        with self._lock:
            heads = [h for hs in self._heads.values() for h in hs if h is not None]
            owners = len({key[0] for key in self._heads})
        return owners, sum(h.nbytes for h in heads), sum(h.index_bytes for h in heads)

    def drop(self, owner: str) -> int:
        """Forget an owner's K/V and indexes; returns the (layer) entries dropped."""
        with self._lock:
            gone = [key for key in self._heads if key[0] == owner]
            for key in gone:
                del self._heads[key]
                self._layer_arrays.pop(key, None)
                self._holding.discard(key)
            self._forget_scans(owner)
            self._forget_nested(owner)
        return len(gone)

    def _forget_nested(self, owner: str) -> None:
        """Drop the kept nested lists of every batch holding ``owner``; the lock held."""
        for key in [key for key in self._nested if owner in key[0]]:
            del self._nested[key]

    def _nested_lists(self, owners: list[str], layer: int, arrays: list) -> tuple:
        """``_layer.nested(arrays)``, kept for the next call with the same rows (``_nested``)."""
        if len(arrays) == 1:
            return _layer.nested(arrays)
        key = (tuple(owners), layer)
        with self._lock:
            kept = self._nested.get(key)
            if kept is not None and all(a is b for a, b in zip(kept[0], arrays)):
                self._nested.move_to_end(key)
                return kept[1]
        cols = _layer.nested(arrays)
        with self._lock:
            if all(self._layer_arrays.get((o, layer)) is a for o, a in zip(owners, arrays)):   # none replaced since
                self._nested[key] = (tuple(arrays), cols)
                while len(self._nested) > NESTED_KEPT:
                    self._nested.popitem(last=False)
        return cols

    def _forget_scans(self, owner: str, layer: int | None = None) -> None:
        """Drop the scan counts of an owner's heads (at ``layer``, or every layer); the lock held."""
        for key in [key for key in self._scans if key[0] == owner and (layer is None or key[1] == layer)]:
            del self._scans[key]

    def __contains__(self, owner: str) -> bool:
        with self._lock:
            return any(key[0] == owner for key in self._heads)

    def nbytes(self) -> int:
        """Bytes of offloaded K/V held (the indexes' own bytes not counted)."""
        return self.held()[1]

    def attend(self, layer: int, owners: list[str], queries: np.ndarray, k: int, scale: float,
               beam: int | None = None) -> Answer:
        """One layer of a decode step: row b's queries [Hq, D] (float32 [B, Hq, D], query head j reading KV head
        j // (Hq / Hkv)) search owner b's indexes at ``layer``; KeyError naming the owner and layer when one is not
        held, ValueError for a malformed call."""
        t0 = time.perf_counter()
        queries = np.ascontiguousarray(queries, np.float32)
        if queries.ndim != 3 or queries.shape[0] != len(owners):
            raise ValueError(f"queries must be [B, Hq, D] with B = {len(owners)} owners, got {queries.shape}")
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        if not np.isfinite(queries).all():      # checked here for both paths (the compiled call checks nothing)
            raise ValueError("queries holds non-finite values (after conversion to float32)")
        with self._lock:
            rows = [self._heads.get((o, layer)) for o in owners]
            arrays = [self._layer_arrays.get((o, layer)) for o in owners]     # made with those heads (``add``)
            # this call's heads' scan counts alone (the record holds every owner's layers: a scan of it would cost
            # a batch's owners x layers x heads at every layer)
            scans = {(o, layer, h): self._scans[(o, layer, h)] for o, heads in zip(owners, rows) if heads is not None
                     for h in range(len(heads)) if (o, layer, h) in self._scans}
        for o, heads in zip(owners, rows):
            if heads is None:
                raise KeyError(f"no offloaded K/V for {o!r} at layer {layer}")
        whole = self._whole_call(layer, owners, queries, rows, arrays, scans, k, scale, beam)
        if whole is not None:
            return Answer(*whole, time.perf_counter() - t0)
        b, hq, d = queries.shape
        out = np.zeros((b, hq, d), np.float32)
        lse = np.full((b, hq), -np.inf, np.float32)
        scanned = np.zeros(b, np.int64)
        searched = []
        for i, heads in enumerate(rows):
            hkv = len(heads)
            if hq % hkv:
                raise ValueError(f"{hq} query heads do not share {hkv} KV heads evenly")
            for h, head in enumerate(heads):
                if head is None:
                    continue
                if head.keys.shape[1] != d:
                    raise ValueError(f"queries have head_dim {d}, the keys of {owners[i]!r} have {head.keys.shape[1]}")
                searched.append((i, h, hkv, head))
        # a (row, KV head)'s query heads in pieces searched apart (``_piece_size``).
        # NOTE: grouped, a piece's heads share one traversal, so which keys a head finds (not how exactly they are
        # attended) depends on the pieces, and so on ``threads`` against the pairs of a call
        plan = []
        for i, h, hkv, head in searched:
            g = hq // hkv
            size = self._piece_size(g, len(searched))
            scan = scans.get((owners[i], layer, h), 0) > 0
            for lo in range(h * g, (h + 1) * g, size):
                plan.append((i, h, head, slice(lo, min(lo + size, (h + 1) * g)), scan))
        jobs = [self._pool.submit(partial_attention, head, queries[i, rows_q], k, scale, beam, self.group_search, scan)
                for i, _, head, rows_q, scan in plan]
        results = [job.result() for job in jobs]
        if self.compiled:
            _layer.warming(self.host_dtype)     # after these searches: their own compile is not kept waiting (once)
        # (owner, KV head) -> (a row of it, scanned, the largest share of its keys a graph search of it read)
        pairs: dict[tuple[str, int], tuple[int, bool, float]] = {}
        for (i, h, head, rows_q, scan), (o, s, n) in zip(plan, results):
            out[i, rows_q], lse[i, rows_q] = o, s
            scanned[i] += n
            heads_read = 1 if self.group_search else rows_q.stop - rows_q.start
            seen = 0.0 if scan else n / (heads_read * head.keys.shape[0])
            pairs[(owners[i], h)] = (i, scan, max(pairs.get((owners[i], h), (i, scan, 0.0))[2], seen))
        self._record("pool", owners, layer, rows, scans, [(i, h, scan, sh) for (_, h), (i, scan, sh) in pairs.items()])
        return Answer(out, lse, scanned, time.perf_counter() - t0)

    def _piece_size(self, g: int, pairs: int) -> int:
        """Query heads a piece of a KV head's group of ``g``, in a call of ``pairs`` (row, KV head) pairs: the group is
        cut when there are fewer pairs than threads (a batch of one has 8 pairs of an 8B-shaped model's 32 query heads
        for 16 cores), so that every thread has work."""
        return -(-g // min(g, max(1, -(-self.threads // max(1, pairs)))))

    def _record(self, path: str, owners: list[str], layer: int, rows: list, scans: dict, pairs) -> None:
        """A call answered by ``path``, and the scan record (``SCAN_SHARE``) of its (row, KV head) ``pairs``, each
        ``(row, head, scanned whole, the largest share of its keys a graph search of it read)``: a scanned head's
        count goes down, a head read past the share is scanned for its next ``SCAN_CALLS`` calls, another forgets its
        count. Heads dropped or replaced since the call took them are left alone."""
        with self._lock:
            self._calls[path] += 1
            if self.scan_share is None:
                return
            for i, h, scan, share in pairs:
                key = (owners[i], layer, int(h))
                if self._heads.get((owners[i], layer)) is not rows[i]:
                    continue                    # dropped or replaced meanwhile: its searches were of others
                if scan:
                    self._scans[key] = scans[key] - 1
                elif share >= self.scan_share:
                    self._scans[key] = SCAN_CALLS
                else:
                    self._scans.pop(key, None)

    def _whole_call(self, layer: int, owners: list[str], queries: np.ndarray, rows: list, arrays: list,
                    scans: dict, k: int, scale: float,
                    beam: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The call in one compiled call with no Python a piece, where every row holds all its heads (one count of
        them) and their arrays, every index is larger than the beam, the pieces are of one size and the call is
        compiled: (out, lse, scanned) as the general path answers them, else None (that path). The pieces then cut
        ``queries`` [B, Hq, D] in order (row, KV head, piece): they are its rows as they lie, and the answer is read
        back in place. (On this repository's 2-core machine, the searches mocked out, a batch of one's call took 207 us
        of Python on the general path and 48 us here.)"""
        if not (rows and self.compiled and self.group_search and _layer.ready(self.host_dtype)) or any(
                a is None for a in arrays):
            return None
        b, hq, d = queries.shape
        hkv = len(rows[0])
        if hq % hkv or any(len(heads) != hkv or lay.dim != d for heads, lay in zip(rows, arrays)):
            return None                     # the general path says what is wrong, or serves it
        g = hq // hkv
        size = self._piece_size(g, b * hkv)
        call_beam = layers_beam(rows, k, beam)
        if g % size or any(lay.num_keys <= call_beam for lay in arrays):
            return None
        per = g // size                     # pieces a (row, KV head)
        scan_pair = np.zeros((b, hkv), np.bool_)     # the pairs scanned whole this call
        counted = np.zeros((b, hkv), np.bool_)       # the pairs with a scan count (``_scans``)
        if scans:
            at: dict[str, list[int]] = {}
            for i, o in enumerate(owners):
                at.setdefault(o, []).append(i)
            for (o, _, h), left in scans.items():
                counted[at[o], h], scan_pair[at[o], h] = True, left > 0
        out, lse, read = _layer.attend(arrays, np.repeat(np.arange(b, dtype=np.int64), hkv * per),
                                       np.tile(np.repeat(np.arange(hkv, dtype=np.int64), per), b),
                                       np.repeat(scan_pair.ravel(), per), queries.reshape(b * hkv * per, size, d),
                                       call_beam, k, scale, self.threads, self._nested_lists(owners, layer, arrays))
        read = read.reshape(b, hkv, per)
        share = read.max(2) / np.stack([lay.head_keys for lay in arrays])      # [B, Hkv]: a group reads a key once
        # the pairs whose record changes (a pair neither counted nor read past the share has no entry to drop)
        hot = [] if self.scan_share is None else zip(*np.nonzero(counted | (share >= self.scan_share)))
        self._record("compiled", owners, layer, rows, scans, [(i, h, scan_pair[i, h], share[i, h]) for i, h in hot])
        return out.reshape(b, hq, -1), lse.reshape(b, hq), read.sum((1, 2))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
