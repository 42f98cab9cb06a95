"""Host time of each step a ratio-0 reuse pass takes before its graph replay (issue #2's `tessera@0`).

The request of bench/engine/engine.py (6 chunks x 512 tokens + a 64-token suffix, every chunk resident), on an
engine whose model is small (the host work does not depend on its size); each step timed alone over
many calls, best of five rounds (us). With --device cuda the copies are real host-to-device ones. The last
row is the general (ratio > 0) pass's RequestTables, built before its first model op.

    python3 bench/engine_host/host_pieces.py [--device cuda] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from host_ops import bench_request, build_engine  # noqa: E402
from services.engine.graphs import reuse_tail  # noqa: E402
from services.engine.graphs.tails import T_BUCKET, bucket, entry_bucket  # noqa: E402
from services.engine.request import PrefillStats  # noqa: E402


def best(fn, n=300, rounds=5) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    out = []
    for _ in range(rounds):
        sync()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t) / n * 1e6)
        sync()
    return round(min(out), 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--json")
    args = ap.parse_args()
    # a small model either way: the pieces timed here do not touch the weights
    eng = build_engine(argparse.Namespace(device="cpu", layers=2, hidden=64), "torch")
    if args.device == "cuda":
        from services.engine import Engine

        eng = Engine.from_state_dict(eng.cfg, _tiny_state(eng), device="cuda", dtype=torch.float32,
                                     attention_backend="torch", kv_cache_bytes=256 << 20)
    fwd = eng.forward
    chunks, suffix = bench_request(1000)
    eng.prefill(chunks, suffix, mode="tessera", recompute_ratio=0.0)
    rows = {"validate (check, chunks known)": best(lambda: eng._validate(chunks, suffix, "tessera", 0.0))}
    req = eng.check(chunks, suffix, "tessera")
    stats = PrefillStats("tessera", 0.0, 1)

    def place():
        for p in fwd._place(req.chunks, "tessera", stats, ids=req.chunk_ids):
            fwd.cache.release(p.entry)

    rows["place (6 cache lookups)"] = best(place)
    placed = fwd._place(req.chunks, "tessera", stats, ids=req.chunk_ids)

    def alloc():
        fwd.pool.free(fwd.cache.allocate(4, for_cache=False))

    rows["allocate + free 4 blocks"] = best(alloc)
    s_blocks = fwd.cache.allocate(4, for_cache=False)
    n_entries = sum(len(p.entry.blocks) for p in placed) + len(s_blocks)
    t, e = bucket(len(suffix), T_BUCKET), entry_bucket(n_entries, fwd.bs)
    tail = fwd.id_tails.get(t, e)
    rows["pack (into a staging buffer)"] = best(
        lambda: reuse_tail.pack(tail.stage(), placed, suffix, s_blocks, fwd.bs, fwd.scratch_block, t, e))
    rows["load (the pinned copy)"] = best(tail.load)
    rows["the kept table (device copy)"] = best(lambda: tail.table(200, 3000, 3136))
    if args.device == "cuda":
        tail.run()
        rows["graph replay (launch)"] = best(lambda: tail.graph.replay(), n=50)
    rows["PrefillStats"] = best(lambda: PrefillStats("tessera", 0.0, 1))
    # a ratio-0.15 pass's request tables (461 recomputed tokens' private blocks, the chunks' device ids)
    from services.engine.passes.blend import RequestTables

    def tables():
        private = []
        RequestTables(fwd, placed, req.chunks, suffix, 461, private, with_chunk_ids=True)
        fwd.pool.free(private)

    rows["request tables (ratio 0.15)"] = best(tables)
    run = reuse_tail.IdsTail.run
    reuse_tail.IdsTail.run = lambda self: self.out  # what is left without the graph and the logits
    logits = fwd.model.logits
    fwd.model.logits = lambda h: h
    try:
        rows["whole prefill, no graph, no logits"] = best(
            lambda: eng.prefill(chunks, suffix, mode="tessera", recompute_ratio=0.0))
    finally:
        reuse_tail.IdsTail.run = run
        fwd.model.logits = logits
    for k, v in rows.items():
        print(f"{k:40s} {v:8.1f} us")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device, "us": rows}, indent=2))
    return 0


def _tiny_state(eng):
    from services.engine.model.tiny import random_weights

    return random_weights(eng.cfg, 0)


if __name__ == "__main__":
    sys.exit(main())
