"""The attention index's build: a graph over one (layer, KV head)'s keys from the queries that attended to
them (RetrievalAttention's attention-aware vector search, issue #22); its compiled loops are in ``_build.py``.

Queries and keys come from different projections, so a query's best keys can lie far apart among the keys
(out of distribution: the paper's Figure 3). A graph built from key-to-key closeness alone (HNSW) must
then scan widely; this one is built from where training queries (the prompt's own prefill queries)
actually look. The build (``build_graph``):

1. exact top-P keys of every training query (inner product, faiss' flat index);
2. projection: each query's best key ("anchor") takes the rest of that query's list as neighbour
   candidates, pruned by the occlusion rule (``_build.prune``) to ``degree``; then reverse edges, pruned
   again (RoarGraph's projected bipartite graph, our own code);
3. connectivity enhancement: every key searched on the graph so far with itself as the query, its beam
   merged into its candidates and pruned, reverse edges again (up to ``EXACT_CANDIDATES`` keys: its exact top
   keys instead of a search's beam);
4. repair, ``repair_rounds`` times: training queries searched on the graph as it stands; each key of a
   query's exact list the search missed gets an edge from the nearest key of that list it found, kept by
   how many queries asked for it up to ``max_degree`` a key (the step that matters most on the longgen
   model's deeper layers: bench/index/README.md);
5. links that make every key reachable from the entries (the ``entries`` keys most training queries ranked first).

Search (``graph.py``, ``_search.py``) is best-first from those entries with a beam.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields

import numpy as np

from services.index import _build


@dataclass(frozen=True, slots=True)
class BuildConfig:
    """Options of ``AttentionIndex.build``, checked once here and stored with the index."""

    degree: int = 32               # occlusion-pruned edges a key (steps 2-3)
    max_degree: int = 64           # edges a key once repaired (step 4); step 5 may add a few past it
    alpha: float = 1.2             # occlusion slack: > 1 keeps more edges
    query_neighbors: int = 100     # P: exact keys a training query links (step 1)
    max_train_queries: int = 65536 # training queries used, a seeded sample of them past this
    build_beam: int = 100          # search list size of steps 3-5
    repair_rounds: int = 2
    repair_queries: int = 20000    # training queries searched a repair round (a seeded sample)
    entries: int = 1               # keys a search starts from: those most training queries rank first
    seed: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            low = 0 if f.name in ("repair_rounds", "seed") else 1
            if f.name != "alpha" and (not isinstance(value, int) or isinstance(value, bool) or value < low):
                raise ValueError(f"{f.name} must be an int >= {low}, got {value!r}")
        if not (isinstance(self.alpha, (int, float)) and 1.0 <= self.alpha <= 4.0):
            raise ValueError(f"alpha must be in [1, 4], got {self.alpha!r}")
        if self.max_degree < self.degree:
            raise ValueError(f"max_degree {self.max_degree} is below degree {self.degree}")

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class Graph:
    """CSR out-edges of every key (offsets int64 ``[N + 1]``, targets int32 ``[E]``) and the keys a search starts
    from (entries int64 ``[>= 1]``: one for a built graph)."""

    offsets: np.ndarray
    targets: np.ndarray
    entries: np.ndarray

    @property
    def num_nodes(self) -> int:
        return self.offsets.shape[0] - 1


def _in_ranges(fn, n: int, threads: int, *args) -> list:
    """``fn(*args, lo, hi)`` over ``[0, n)`` cut in ranges, on ``threads`` threads; results in range order."""
    parts = max(1, min(4 * threads, n // 256))
    bounds = np.linspace(0, n, parts + 1).astype(np.int64)
    if threads == 1:
        return [fn(*args, int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda r: fn(*args, int(r[0]), int(r[1])), zip(bounds[:-1], bounds[1:])))


def _concat_pairs(results: list) -> tuple[np.ndarray, np.ndarray]:
    return np.concatenate([s for s, _ in results]), np.concatenate([d for _, d in results])


def _csr(n: int, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CSR of pairs, each source's targets in the pairs' order (stable)."""
    order = np.argsort(src, kind="stable")
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(src, minlength=n), out=offsets[1:])
    return offsets, dst[order].astype(np.int32)


def _edges(offsets: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return np.repeat(np.arange(offsets.shape[0] - 1), np.diff(offsets)), targets.astype(np.int64)


def _pruned(keys, sq_norms, src, dst, cfg: BuildConfig, threads: int) -> tuple[np.ndarray, np.ndarray]:
    """Every key's candidates (the pairs' targets) pruned to ``cfg.degree``: CSR."""
    n = keys.shape[0]
    pairs = _distinct(src * n + dst)    # a candidate named twice (training queries share anchors) is pruned once
    c_offsets, c_targets = _csr(n, pairs // n, pairs % n)
    results = _in_ranges(_build.prune_range, n, threads, keys, sq_norms, c_offsets, c_targets.astype(np.int64),
                         cfg.degree, np.float32(cfg.alpha))
    counts = np.concatenate([c for c, _ in results])
    adj = np.concatenate([a for _, a in results])
    return _csr(n, np.repeat(np.arange(n), counts), adj[adj >= 0])


def _distinct(values: np.ndarray) -> np.ndarray:
    """Sorted distinct values (by a sort: numpy's hashing ``unique`` is several times slower on these)."""
    values = np.sort(values)
    return values[np.concatenate([[True], values[1:] != values[:-1]])] if values.size else values


def _with_reverse(keys, sq_norms, offsets, targets, cfg, threads):
    src, dst = _edges(offsets, targets)
    return _pruned(keys, sq_norms, np.concatenate([src, dst]), np.concatenate([dst, src]), cfg, threads)


def _add_ranked(offsets, targets, src, dst, cap: int | None):
    """Add the pairs not yet edges, most-requested first, while a key has fewer than ``cap`` edges: each key's new
    targets after its own, by descending request count, then ascending id.
    NOTE: only the pairs are sorted; the edges are tested and copied in compiled passes (``_build``): sorting every
    edge again took 0.80 s of a 0.80 s repair (32,768 keys, 256 queries, one thread)."""
    n = offsets.shape[0] - 1
    pairs, counts = np.unique(src * n + dst, return_counts=True)
    p_src, p_dst = pairs // n, pairs % n
    new = (p_src != p_dst) & _build.absent_pairs(offsets, targets, p_src, p_dst)
    p_src, p_dst, counts = p_src[new], p_dst[new], counts[new]
    order = np.lexsort((-counts, p_src))
    a_src, a_dst = p_src[order], p_dst[order]
    if cap is not None:
        first = np.searchsorted(a_src, a_src, side="left")        # rank of each pair within its source
        room = cap - np.diff(offsets)[a_src]
        keep = (np.arange(a_src.shape[0]) - first) < room
        a_src, a_dst = a_src[keep], a_dst[keep]
    return _build.append_edges(offsets, targets, a_src, a_dst)


def given_lists(lists, m: int, n: int, p: int) -> np.ndarray:
    """Exact lists computed elsewhere (on the GPU, where the keys were: services/engine/decode/retrieval.py) for ``m``
    training queries over ``n`` keys, each row best first: int64 ``[m, p]`` (their first ``p`` columns), or a
    ValueError saying what does not fit. An id out of range would be read out of bounds by the compiled loops."""
    arr = np.asarray(lists)
    if arr.ndim != 2 or arr.shape[0] != m or arr.shape[1] < p or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"exact lists must be integer [{m}, >= {p}] (a row a training query, best first), got "
                         f"{arr.dtype} {arr.shape}")
    arr = np.ascontiguousarray(arr[:, :p], np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= n):
        raise ValueError(f"exact lists name keys outside 0..{n - 1}")
    return arr


def exact_lists(keys: np.ndarray, queries: np.ndarray, p: int, threads: int) -> np.ndarray:
    """int64 ``[M, p]``: each query's top-``p`` keys by inner product, best first, searched on ``threads`` OpenMP
    threads.
    NOTE: an OpenMP thread count is the calling thread's own: set in one thread it leaves every other at the default
    (all of the host's cores), so each build thread sets its own here, or builds running side by side would each start
    a pool of every core for their faiss search."""
    import faiss

    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(threads)
    try:
        flat = faiss.IndexFlatIP(keys.shape[1])
        flat.add(keys)
        _, ids = flat.search(queries, p)
    finally:
        faiss.omp_set_num_threads(before)
    return ids.astype(np.int64)


def _repair_picks(rng, m: int, cfg: BuildConfig) -> list[np.ndarray]:
    """The training queries each repair round searches: a seeded sample of ``cfg.repair_queries`` of ``m``, sorted."""
    return [np.sort(rng.choice(m, min(cfg.repair_queries, m), replace=False)) for _ in range(cfg.repair_rounds)]


def _repair(keys, sq_norms, offsets, targets, entries, train, lists, picks, cfg: BuildConfig, threads: int):
    """Step 4: a round per sample of ``picks``, its training queries searched on the graph, each exact-list key a
    search missed linked from the nearest it found (``lists``: the exact lists, needed for the picked rows only)."""
    for pick in picks:
        wanted = _concat_pairs(_in_ranges(_build.repair_pairs, pick.shape[0], threads, keys, sq_norms, offsets,
                                          targets, entries, train[pick], lists[pick], cfg.build_beam))
        offsets, targets = _add_ranked(offsets, targets, *wanted, cfg.max_degree)
    return offsets, targets


def repair_graph(keys: np.ndarray, graph: Graph, train: np.ndarray, cfg: BuildConfig,
                 threads: int | None = None, lists: np.ndarray | None = None) -> Graph:
    """Step 4 alone, on a graph made elsewhere: a composition of chunk graphs (``AttentionIndex.compose``), which has
    no edge between its parts, so a search reaches a part only through its own entries. The request's queries
    (``train``, in the keys' frame) link each key their searches miss from the nearest they find, across parts
    too. On the longgen model's Q/K (bench/index/README.md, 192 64-key chunks and 304 other keys), composed recall@100
    was 0.41 at 18% of the keys scored and never reached 20%; repaired in one round (``heads.COMPOSED``), 0.910 at 20%
    against 0.955 for the request's own index, the repair taking 0.2x that index's build (two rounds: 0.923, 0.4x).
    ``lists``: the training queries' exact lists, computed elsewhere (``given_lists``), instead of here."""
    threads = threads or len(os.sched_getaffinity(0))
    rng = np.random.default_rng(cfg.seed)
    p = min(cfg.query_neighbors, keys.shape[0])
    given = None if lists is None else given_lists(lists, train.shape[0], keys.shape[0], p)
    if train.shape[0] > cfg.max_train_queries:
        kept = np.sort(rng.choice(train.shape[0], cfg.max_train_queries, replace=False))
        train, given = train[kept], None if given is None else given[kept]
    sq_norms = np.einsum("nd,nd->n", keys, keys).astype(np.float32)
    picks = _repair_picks(rng, train.shape[0], cfg)
    # NOTE: the exact lists of the picked queries only: with repair_queries 256 of a request's 2,048 a head at 130,048
    # keys, the lists of all took 2.60 s of a 3.00 s repair (one thread), their searches 0.07 s
    lists = np.zeros((train.shape[0], p), np.int64) if given is None else given
    if picks and given is None:
        used = np.unique(np.concatenate(picks))
        lists[used] = exact_lists(keys, train[used], p, threads)
    offsets, targets = _repair(keys, sq_norms, graph.offsets, graph.targets.astype(np.int32), graph.entries, train,
                               lists, picks, cfg, threads)
    return Graph(offsets, targets, graph.entries)


# NOTE: step 3 of an index of at most this many keys (a chunk's: 512 tokens) takes each key's exact top ``build_beam``
# keys by inner product (faiss' flat index) instead of searching the graph for them: what the search approximates
EXACT_CANDIDATES = 2048


def build_graph(keys: np.ndarray, train: np.ndarray, cfg: BuildConfig, threads: int | None = None,
                lists: np.ndarray | None = None) -> Graph:
    """The graph of the module docstring's steps 1-5. ``keys`` float32 ``[N, D]``, ``train`` float32 ``[M, D]``,
    both C-contiguous and finite. The result does not depend on ``threads`` (default: this process' CPUs).
    ``lists``: step 1's exact lists of ``train``, computed elsewhere (``given_lists``), instead of here."""
    threads = threads or len(os.sched_getaffinity(0))
    n = keys.shape[0]
    rng = np.random.default_rng(cfg.seed)
    p = min(cfg.query_neighbors, n)
    given = None if lists is None else given_lists(lists, train.shape[0], n, p)
    if train.shape[0] > cfg.max_train_queries:
        kept = np.sort(rng.choice(train.shape[0], cfg.max_train_queries, replace=False))
        train, given = train[kept], None if given is None else given[kept]
    sq_norms = np.einsum("nd,nd->n", keys, keys).astype(np.float32)
    lists = exact_lists(keys, train, p, threads) if given is None else given
    firsts = np.bincount(lists[:, 0], minlength=n)
    entry = np.argsort(-firsts, kind="stable")[:min(cfg.entries, n)].astype(np.int64)

    p = lists.shape[1]
    offsets, targets = _pruned(keys, sq_norms, np.repeat(lists[:, 0], p - 1), lists[:, 1:].reshape(-1), cfg, threads)
    offsets, targets = _with_reverse(keys, sq_norms, offsets, targets, cfg, threads)

    if n <= EXACT_CANDIDATES:    # what each key's search looks for, found exactly
        beams = exact_lists(keys, keys, min(cfg.build_beam, n), threads)
        found = np.repeat(np.arange(n, dtype=np.int64), beams.shape[1]), beams.reshape(-1)
    else:
        found = _concat_pairs(_in_ranges(_build.search_candidates, n, threads, keys, offsets, targets, entry,
                                         cfg.build_beam))
    src, dst = _edges(offsets, targets)
    offsets, targets = _pruned(keys, sq_norms, np.concatenate([src, found[0]]), np.concatenate([dst, found[1]]),
                               cfg, threads)
    offsets, targets = _with_reverse(keys, sq_norms, offsets, targets, cfg, threads)

    offsets, targets = _repair(keys, sq_norms, offsets, targets, entry, train, lists,
                               _repair_picks(rng, train.shape[0], cfg), cfg, threads)
    links = _build.link_unreachable(keys, sq_norms, offsets, targets, entry, cfg.build_beam)
    offsets, targets = _add_ranked(offsets, targets, *links, None)
    return Graph(offsets, targets, entry)
