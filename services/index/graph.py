"""``AttentionIndex``: one (layer, KV head)'s keys and the graph over them, searched by inner product.

A search returns, per query, up to ``k`` key ids by descending inner product and how many keys it scored
(``scanned``, the index's cost). Contract the engine and the index service rely on:

- ``k >= num_keys`` scores every key: the result is exact (all keys, sorted) and ``scanned == num_keys``;
- with fewer than ``k`` keys, ids are padded with -1 at the end;
- searches may run on several threads at once (compiled loops without the GIL, state per call);
- an index is immutable; ``to_bytes``/``from_bytes`` round-trip it exactly (``format.py``);
- a search traverses the graph scoring the keys' int8 form (``compact.py``), then scores its beam again with the exact
  keys and keeps the k best of those exact scores: the ids returned are ranked, and attended, by exact inner products
  (``compact=False``: the traversal scores the float32 keys, bench/index/README.md's A/B);
- the exact keys are held in float32 or, with ``key_dtype="bfloat16"``, rounded to bfloat16 (``half.py``: half the
  bytes); the graph and the int8 codes are then built from the rounded keys, and "exact" means exact over them.

How the graph is built: ``build.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from services.index._scan import scan_attend_group
from services.index import half, scratch
from services.index._search import search_attend_into, search_batch_into
from services.index._search_group import search_attend_group_into, search_group_batch_into
from services.index.build import BuildConfig, Graph, build_graph, repair_graph
from services.index.compact import CompactKeys, quantize
from services.index.format import IndexFormatError, IndexParts, check_graph, decode, encode

# Search list size when the caller names none: bench/index/README.md measures recall@100 by beam.
DEFAULT_BEAM = 128


def _matrix(name: str, value, dim: int | None = None, allow_empty: bool = False) -> np.ndarray:
    """``value`` as a C-contiguous float32 ``[rows, dim]`` array, or a ValueError naming ``name``."""
    try:
        arr = np.asarray(value)
    except Exception as exc:        # noqa: BLE001 - anything numpy cannot read is a bad argument
        raise ValueError(f"{name} is not an array: {exc}") from None
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D [rows, dim], got shape {arr.shape}")
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{name} must hold real numbers, got dtype {arr.dtype}")
    if arr.shape[1] < 1 or (arr.shape[0] < 1 and not allow_empty):
        raise ValueError(f"{name} must be non-empty, got shape {arr.shape}")
    if dim is not None and arr.shape[1] != dim:
        raise ValueError(f"{name} has dim {arr.shape[1]}, the index holds dim {dim}")
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} holds non-finite values (after conversion to float32)")
    return arr


def _held(name: str, value, key_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Keys checked as ``_matrix`` checks them (bfloat16 bits, uint16, are widened first), then held as ``key_dtype``:
    (what the index holds, a copy of its own; those keys in float32, what its graph and codes are built from)."""
    half.check_dtype("key_dtype", key_dtype)
    arr = np.asarray(value)
    keys = _matrix(name, half.widen(arr) if arr.dtype == half.BITS and arr.ndim == 2 else arr)
    if key_dtype == half.FLOAT32:
        keys = keys.copy()              # the index owns (and freezes) its keys, never the caller's
        return keys, keys
    held = half.to_bf16(keys)
    return held, half.widen(held)


def _count(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


class AttentionIndex:
    """Keys ``[N, D]`` (float32, or bfloat16 bits: ``half.py``), their compact form (derived from them) and a graph
    over them. Make one with ``build``, ``compose`` or ``from_bytes``."""

    __slots__ = ("_keys", "_compact", "_ones", "_graph", "_config")

    def __init__(self, keys: np.ndarray, graph: Graph, config: BuildConfig, compact: CompactKeys | None = None):
        """``keys``: float32 or bfloat16 bits (``half.py``); ``compact``: ``quantize`` of them when the caller has it
        already (an index of the same keys)."""
        check_graph(keys, graph.offsets, graph.targets, graph.entries)
        for arr in (keys, graph.offsets, graph.targets, graph.entries):
            arr.setflags(write=False)      # shared by every searching thread
        self._keys, self._graph, self._config = keys, graph, config
        self._compact = quantize(half.as_float(keys)) if compact is None else compact
        self._ones = np.ones(keys.shape[1], np.float32)        # the step of float32 navigation
        self._ones.setflags(write=False)

    @classmethod
    def build(cls, keys, train_queries, *, threads: int | None = None, key_dtype: str = half.FLOAT32,
              lists=None, compact: CompactKeys | None = None, **options) -> "AttentionIndex":
        """Index ``keys`` ``[N, D]`` for queries like ``train_queries`` ``[M, D]`` (the prefill queries that
        attended to these keys; every query head of the KV head's group may be stacked). ``options`` are
        ``BuildConfig``'s fields (``degree``, ``max_degree``, ``alpha``, ``query_neighbors``, ...);
        ``threads`` (default: this process' CPUs) changes the build's speed, never its graph. ``key_dtype``: how the
        index holds its exact keys (``half.DTYPES``); bfloat16 rounds them first and builds from what it holds.
        ``lists``: each training query's exact top keys by inner product, best first (int ``[M, >= P]``), computed
        elsewhere (on the GPU that holds the keys) instead of by the build (``build.given_lists``). ``compact``:
        ``quantize`` of the keys as held, when the caller has it (an ``unlinked`` index of them)."""
        held, keys = _held("keys", keys, key_dtype)
        train = _matrix("train_queries", train_queries, dim=keys.shape[1])
        try:
            config = BuildConfig(**options)
        except TypeError as exc:
            raise ValueError(f"unknown build option: {exc}") from None
        if threads is not None:
            _count("threads", threads, 1)
        return cls(held, build_graph(keys, train, config, threads, lists), config,
                   quantize(keys) if compact is None else compact)

    @classmethod
    def unlinked(cls, keys, key_dtype: str = half.FLOAT32) -> "AttentionIndex":
        """``keys`` ``[N, D]`` held with a graph of no edge (one entry, key 0): what a head is searched by until its
        index is built, scanning every key (``search_group(scan=True)``, ``attend_group(scan=True)``); a graph search
        of it finds its entry alone. ``key_dtype`` as ``build``'s. Keys given C-contiguous in that dtype are held as
        they are (a read-only view, not a copy: the caller leaves them as they are); others as ``build`` holds them."""
        arr = np.asarray(keys)
        if arr.ndim == 2 and arr.shape[0] and arr.flags.c_contiguous and half.dtype_of(arr) == key_dtype and (
                arr.dtype == half.BITS or arr.dtype == np.float32):
            if not (half.finite(arr) if arr.dtype == half.BITS else np.isfinite(arr).all()):
                raise ValueError("keys holds non-finite values")
            held = arr.view()
            as_float = half.as_float(held)
        else:
            held, as_float = _held("keys", keys, key_dtype)
        graph = Graph(np.zeros(held.shape[0] + 1, np.int64), np.zeros(0, np.int32), np.zeros(1, np.int64))
        return cls(held, graph, BuildConfig(), quantize(as_float))

    @classmethod
    def compose(cls, keys, parts: Sequence[Graph], config: BuildConfig | None = None,
                key_dtype: str = half.FLOAT32, compact: CompactKeys | None = None) -> "AttentionIndex":
        """One index over ``keys`` ``[N, D]`` made of graphs built apart (a chunk's, in its own frame: the keys here
        may be rotated from the frame it was built in, by one rotation a part, which keeps every distance the
        graph was built from). Part i covers the next ``parts[i].num_nodes`` keys, in order, and the parts cover all
        N. No edge joins two parts: a search starts from every part's entries and one beam spans them, so the
        parts whose entries score best are explored first. ``config``: the options kept with it (default ones);
        ``key_dtype`` and ``compact`` as ``build``'s."""
        held, keys = _held("keys", keys, key_dtype)
        if not parts:
            raise ValueError("compose needs at least one part")
        sizes = [p.num_nodes for p in parts]
        if sum(sizes) != keys.shape[0]:
            raise ValueError(f"the parts cover {sum(sizes)} keys, {keys.shape[0]} were given")
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        edges = np.concatenate([[0], np.cumsum([p.targets.shape[0] for p in parts])]).astype(np.int64)
        offsets = np.concatenate([[0]] + [p.offsets[1:] + e for p, e in zip(parts, edges[:-1])]).astype(np.int64)
        targets = np.concatenate([p.targets.astype(np.int64) + s for p, s in zip(parts, starts)]).astype(np.int32)
        entries = np.concatenate([p.entries + s for p, s in zip(parts, starts)]).astype(np.int64)
        try:
            return cls(held, Graph(offsets, targets, entries), config or BuildConfig(),
                       quantize(keys) if compact is None else compact)
        except IndexFormatError as exc:
            raise ValueError(f"a part is not a graph over its keys: {exc}") from None

    def repaired(self, train_queries, *, threads: int | None = None, lists=None) -> "AttentionIndex":
        """This index with the links its searches for ``train_queries`` ``[M, D]`` lacked (``build.repair_graph``):
        for a composed one, the edges between its parts that the request's own queries show. ``lists``: as
        ``build``'s, over all its keys."""
        train = _matrix("train_queries", train_queries, dim=self.dim)
        if threads is not None:
            _count("threads", threads, 1)
        return AttentionIndex(self._keys, repair_graph(half.as_float(self._keys), self._graph, train, self._config,
                                                       threads, lists),
                              self._config, self._compact)      # the same keys: their codes too

    @property
    def graph(self) -> Graph:
        """Its graph (read-only arrays)."""
        return self._graph

    @property
    def num_keys(self) -> int:
        return self._keys.shape[0]

    @property
    def dim(self) -> int:
        return self._keys.shape[1]

    @property
    def num_edges(self) -> int:
        return self._graph.targets.shape[0]

    @property
    def config(self) -> BuildConfig:
        return self._config

    @property
    def compact(self) -> CompactKeys:
        """The int8 keys its searches traverse with (``compact.py``)."""
        return self._compact

    @property
    def key_dtype(self) -> str:
        """How its exact keys are held: ``half.FLOAT32`` or ``half.BFLOAT16``."""
        return half.dtype_of(self._keys)

    @property
    def nbytes(self) -> int:
        """Bytes held in memory: keys, their compact form, graph."""
        return self._keys.nbytes + self._compact.nbytes + self._graph.offsets.nbytes + self._graph.targets.nbytes

    def _nav(self, compact: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        """What the compiled search takes: (nav, step, exact keys, exact_nav) (``_search.py``)."""
        if compact:
            return self._compact.codes, self._compact.step, self._keys, False
        return self._keys, self._ones, self._keys, True

    def search(self, queries, k: int = 100, *, beam: int | None = None, compact: bool = True,
               ) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` keys of each query ``[B, D]`` by inner product: ids int64 ``[B, k]`` (best first, -1
        padded) and scanned int64 ``[B]`` (keys the traversal scored; it then reads the beam's exact keys).
        ``beam`` (>= k; default max(k, DEFAULT_BEAM)) is the search list size: larger finds more of the true
        top-k and scores more keys. ``compact``: traverse on the int8 keys (else the float32 ones)."""
        queries = _matrix("queries", queries, dim=self.dim, allow_empty=True)
        k, beam = self._beam(k, beam)
        if k >= self.num_keys or beam >= self.num_keys:
            return self._exact(queries, k)
        b = queries.shape[0]
        ids, scores, scanned = np.empty((b, k), np.int64), np.empty((b, k), np.float32), np.empty(b, np.int64)
        if b:
            g = self._graph
            nav, step, keys, exact_nav = self._nav(compact)
            with scratch.searching():
                search_batch_into(nav, step, keys, g.offsets, g.targets, g.entries, queries, beam, k, exact_nav, ids,
                                  scores, scanned, *scratch.one(nav.shape[0], beam))
        return ids, scanned

    def _exact(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Every key scored; ties in key order."""
        n = self.num_keys
        ids = np.full((queries.shape[0], k), -1, np.int64)
        if queries.shape[0]:
            scores = queries @ half.as_float(self._keys).T                # [B, N]
            top = np.argsort(-scores, axis=1, kind="stable")[:, : min(k, n)]
            ids[:, : top.shape[1]] = top
        return ids, np.full(queries.shape[0], n, np.int64)

    def attend(self, queries, values: np.ndarray, k: int, scale: float, *, beam: int | None = None,
               compact: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Attention of each query ``[B, D]`` over its top-``k`` keys (searched as ``search`` does) with
        ``values`` ``[num_keys, Dv]`` (row i: key i's value; float32 or bfloat16 bits): out float32 ``[B, Dv]``, lse
        float32 ``[B]`` (natural log of the summed exp of the scaled scores q.k * scale) and scanned int64 ``[B]``. One
        compiled call without the GIL; the scores are the exact ones of the search's rescore. ``k >= num_keys`` attends
        every key, exactly."""
        queries = _matrix("queries", queries, dim=self.dim, allow_empty=True)
        values = self._values(values)
        k, beam = self._beam(k, beam)
        b = queries.shape[0]
        if k >= self.num_keys or beam >= self.num_keys:
            logits = (queries @ half.as_float(self._keys).T).astype(np.float64) * scale       # [B, N]
            top = logits.max(axis=1, keepdims=True) if b else logits[:, :0]
            p = np.exp(logits - top)
            total = p.sum(axis=1)
            out = ((p / total[:, None]) @ half.as_float(values)).astype(np.float32)
            return out, (top[:, 0] + np.log(total)).astype(np.float32), np.full(b, self.num_keys, np.int64)
        out = np.empty((b, values.shape[1]), np.float32)
        lse = np.empty(b, np.float32)
        scanned = np.empty(b, np.int64)
        if b:
            g = self._graph
            nav, step, keys, exact_nav = self._nav(compact)
            with scratch.searching():
                search_attend_into(nav, step, keys, g.offsets, g.targets, g.entries, values, queries, beam, k,
                                   exact_nav, float(scale), out, lse, scanned, *scratch.one(nav.shape[0], beam))
        return out, lse, scanned

    def search_group(self, queries, k: int = 100, *, beam: int | None = None, compact: bool = True,
                     ) -> tuple[np.ndarray, np.ndarray]:
        """``search`` for GQA groups: queries float32 ``[B, G, D]`` (the G query heads reading this KV head), each
        group searched in one traversal that reads a key once for all G (``_search_group``): ids int64 ``[B, G, k]``
        (each head's own top-k, best first, -1 padded) and scanned int64 ``[B]`` (keys read for the group, once
        each). With G = 1 it is ``search``, id for id."""
        queries, b, g = self._groups(queries)
        k, beam = self._beam(k, beam)
        if k >= self.num_keys or beam >= self.num_keys:
            ids, _ = self._exact(queries.reshape(b * g, self.dim), k)
            return ids.reshape(b, g, k), np.full(b, self.num_keys, np.int64)
        ids = np.empty((b, g, k), np.int64)
        scores = np.empty((b, g, k), np.float32)
        scanned = np.empty(b, np.int64)
        if b:
            gr = self._graph
            nav, step, keys, exact_nav = self._nav(compact)
            with scratch.searching():
                search_group_batch_into(nav, step, keys, gr.offsets, gr.targets, gr.entries, queries, beam, k,
                                        exact_nav, ids, scores, scanned, *scratch.group(nav.shape[0], g, beam))
        return ids, scanned

    def attend_group(self, queries, values: np.ndarray, k: int, scale: float, *, beam: int | None = None,
                     compact: bool = True, scan: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``attend`` for GQA groups, searched as ``search_group`` does: queries ``[B, G, D]`` -> out float32
        ``[B, G, Dv]``, lse float32 ``[B, G]`` and scanned int64 ``[B]`` (keys read for each group). ``scan``: a
        whole scan instead of the graph (``_scan``): every key's int8 code scored against each head, each head's best
        ``beam`` rescored with the exact keys and its top ``k`` attended; scanned is then ``num_keys``."""
        queries, b, g = self._groups(queries)
        values = self._values(values)
        k, beam = self._beam(k, beam)
        if b * g == 0 or k >= self.num_keys or beam >= self.num_keys:
            out, lse, _ = self.attend(queries.reshape(b * g, self.dim), values, k, scale, beam=beam)
            return out.reshape(b, g, -1), lse.reshape(b, g), np.full(b, self.num_keys, np.int64)
        out = np.empty((b, g, values.shape[1]), np.float32)
        lse = np.empty((b, g), np.float32)
        if scan:
            scan_attend_group(self._compact.codes, self._compact.step, self._keys, values, queries, beam, k,
                              float(scale), out, lse)
            return out, lse, np.full(b, self.num_keys, np.int64)
        scanned = np.empty(b, np.int64)
        gr = self._graph
        nav, step, keys, exact_nav = self._nav(compact)
        with scratch.searching():
            search_attend_group_into(nav, step, keys, gr.offsets, gr.targets, gr.entries, values, queries, beam, k,
                                     exact_nav, float(scale), out, lse, scanned, *scratch.group(nav.shape[0], g, beam))
        return out, lse, scanned

    def _groups(self, queries) -> tuple[np.ndarray, int, int]:
        """Queries ``[B, G, D]`` as float32 C-contiguous, checked as ``_matrix`` checks rows, with B and G."""
        arr = np.asarray(queries)
        if arr.ndim != 3 or arr.shape[1] < 1:
            raise ValueError(f"queries must be 3-D [groups, heads, dim] with heads >= 1, got shape {arr.shape}")
        b, g = arr.shape[:2]
        flat = _matrix("queries", arr.reshape(b * g, arr.shape[2]), dim=self.dim, allow_empty=True)
        return flat.reshape(b, g, self.dim), b, g

    def _beam(self, k, beam) -> tuple[int, int]:
        k = _count("k", k, 1)
        beam = max(k, DEFAULT_BEAM) if beam is None else _count("beam", beam, 1)
        if beam < k:
            raise ValueError(f"beam must be >= k ({k}), got {beam}")
        return k, beam

    def _values(self, values: np.ndarray) -> np.ndarray:
        if values.dtype not in (np.float32, half.BITS) or values.ndim != 2 or values.shape[0] != self.num_keys:
            raise ValueError(f"values must be float32 or bfloat16 bits (uint16) [{self.num_keys}, Dv], got "
                             f"{values.dtype} {values.shape}")
        return np.ascontiguousarray(values)

    @property
    def keys(self) -> np.ndarray:
        """The keys it searches, ``[num_keys, D]`` as it holds them (float32 or bfloat16 bits: ``key_dtype``;
        read-only: the index owns them)."""
        return self._keys

    def to_bytes(self) -> bytes:
        g = self._graph
        return encode(IndexParts(self._keys, g.offsets, g.targets, g.entries, self._config.as_dict()))

    @classmethod
    def from_bytes(cls, blob: bytes) -> "AttentionIndex":
        """The index ``to_bytes`` wrote; ``IndexFormatError`` (a ValueError) for anything else."""
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise IndexFormatError(f"blob must be bytes, got {type(blob).__name__}")
        parts = decode(blob)
        try:
            config = BuildConfig(**parts.config)
        except (TypeError, ValueError) as exc:
            raise IndexFormatError(f"index options are not this version's: {exc}") from None
        return cls(parts.keys, Graph(parts.offsets, parts.targets, parts.entries), config)

    def __repr__(self) -> str:
        return f"AttentionIndex(num_keys={self.num_keys}, dim={self.dim}, num_edges={self.num_edges})"

