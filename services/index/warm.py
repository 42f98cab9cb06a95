"""Compile the index's numba loops now, or load them from numba's cache: builds, composition and repair, the searches
of one head and of a query group, the scans, the int8 codes, and a layer's searches in one parallel call, for keys
and values held in each storage dtype.

A process that has not (the first retrieval sequence of a decode engine, a fresh index service, a test worker)
compiles them with the interpreter lock held in its first build (~30-40 s) and its first compiled search (~25 s on
this repository's 2-core machine, ~2 s loading numba's cache). Run here on a few hundred random keys, in the order
and with the argument types the index set uses, they fill numba's cache for every process that follows:

    python -m services.index.warm [--dtypes float32,bfloat16]

``make test`` runs it before the tests, beside the linters, so that its two test workers (and the services the tests
start) load what one process compiled, not each compile it.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from services.index import _layer, half


def warm(dtypes=half.DTYPES, say=None) -> dict[str, float]:
    """Every compiled path of an ``IndexSet`` (and an ``AttentionIndex`` alone) run once for each storage dtype:
    seconds a dtype. ``say``: called with a line as each is done."""
    from services.index.chunks import ChunkIndex
    from services.index.graph import AttentionIndex
    from services.index.heads import IndexSet

    rng = np.random.default_rng(0)
    hkv, g, n, m, d = 2, 2, 320, 400, 16
    keys = rng.standard_normal((hkv, n, d), dtype=np.float32)
    values = rng.standard_normal((hkv, n, d), dtype=np.float32)
    train = rng.standard_normal((hkv, m, d), dtype=np.float32) + 0.5
    lists = np.argsort(-np.einsum("hmd,hnd->hmn", train, keys), axis=2, kind="stable")[:, :, :100].astype(np.int32)
    queries = rng.standard_normal((1, hkv * g, d), dtype=np.float32)
    chunk = ChunkIndex.build([keys[:, :160]], [train], threads=1)
    seconds = {}
    for dtype in dtypes:
        t0 = time.perf_counter()
        indexes = IndexSet(threads=2, host_dtype=dtype, scan_share=None)
        try:
            held = half.stored(keys, dtype)
            indexes.add("own", 0, held, values, train)                         # a build of its own
            indexes.add("given", 0, held, values, train, lists=lists)          # from lists ranked elsewhere
            indexes.add("chunk", 0, held, values, train, chunks=[("c", chunk)], lists=lists)   # composed, repaired
            _layer.warm(dtype)
            for compiled in (True, False):                                     # one parallel call; the thread pool
                indexes.compiled = compiled
                for owners in (["own"], ["given", "chunk"]):
                    indexes.attend(0, owners, np.repeat(queries, len(owners), 0), k=8, scale=d ** -0.5)
            scanning = IndexSet(threads=2, host_dtype=dtype, scan_share=1.0)   # heads scanned whole
            scanning.add("own", 0, held, values, train)
            scanning.attend(0, ["own"], queries, k=8, scale=d ** -0.5)
            scanning.close()
            alone = AttentionIndex.build(keys[0], train[0], threads=1, key_dtype=dtype)
            for compact in (True, False):
                alone.search(queries[0, :g], k=8, compact=compact)
                alone.search_group(queries[:, :g], k=8, compact=compact)
        finally:
            indexes.close()
        seconds[dtype] = time.perf_counter() - t0
        if say is not None:
            say(f"index loops for {dtype} ready in {seconds[dtype]:.1f} s")
    return seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m services.index.warm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default=",".join(half.DTYPES),
                    help=f"storage dtypes to compile for, of {', '.join(half.DTYPES)} (default: all)")
    args = ap.parse_args(argv)
    dtypes = [t for t in args.dtypes.split(",") if t]
    for t in dtypes:
        half.check_dtype("--dtypes", t)
    warm(dtypes, say=print)
    return 0


if __name__ == "__main__":
    sys.exit(main())
