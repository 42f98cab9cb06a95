"""What an admission costs a decode worker's engine thread when the hand-off's shared chunks were evicted between its
preparation and its admission (a batch's chunks past the chunk cache), two ways, alternated request by request:

- ``engine``: the import reads them itself (``Engine.import_handoff`` with the worker's own fetch: a store lookup and
  a read, on the thread the whole batch waits for): what an admission did before the batcher's restage;
- ``restaged``: a helper thread reads them first (``prepare.fetch_more``, what the restage runs), and the import takes
  them from memory. The helper's time is reported beside the engine thread's.

One store shard in its own process with its DRAM tier in shared memory (the arena, read in place by the worker), a
tiny random model on the CPU (``--layers``, ``--chunk-tokens``, ``--chunks`` a request). On a GPU the engine
thread's read is an arena copy onto the device and a wait for its check; here it is the CPU's copy and checksum, so
the figures are this machine's, not a GPU worker's.

    .venv/bin/python bench/handoff/restage.py --requests 20 --json F
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench" / "kvstore"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20, help="requests, each timed both ways (alternated)")
    ap.add_argument("--chunks", type=int, default=6, help="shared chunks a request, all evicted before its admission")
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8, help="the tiny model's layers")
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args()
    if args.requests < 1 or args.chunks < 1 or args.chunk_tokens < 1 or args.layers < 1:
        ap.error("--requests, --chunks, --chunk-tokens and --layers must be at least 1")

    from store_to_gpu import start_store

    from services.cluster.kvio import StoreAccess
    from services.engine import Engine
    from services.engine.model.tiny import write_tiny
    from services.handoff.prepare import fetch_more, prepare
    from services.handoff.transport import ReceivedHandoff
    from services.kvstore.client import KVStoreClient
    from services.rpc import tessera_pb2 as pb

    work = Path(tempfile.mkdtemp(prefix="tessera-restage-"))
    shm = tempfile.mkdtemp(prefix="tessera-restage-", dir="/dev/shm")
    proc = None
    try:
        model = write_tiny(work / "model", num_layers=args.layers)
        prefill = Engine.load(str(model), kv_cache_bytes=256 << 20)
        decode = Engine.load(str(model), kv_cache_bytes=256 << 20)
        proc, address = start_store(1 << 30, work / "store", shm)
        put = KVStoreClient(address, timeout=30)
        store = StoreAccess([address])
        rng = random.Random(7)
        vocab = prefill.cfg.vocab_size

        def fetch(cid: str):        # the decode worker's own fetch (services/decode/server.py), on the engine thread
            return store.fetcher(store.lookup([cid]), None)(cid)

        times: dict[str, list[float]] = {"engine": [], "restaged": [], "helper": []}
        for r in range(args.requests):
            chunks = [[rng.randrange(4, vocab) for _ in range(args.chunk_tokens)] for _ in range(args.chunks)]
            _, h = prefill.prefill_handoff(chunks, [rng.randrange(4, vocab) for _ in range(16)], recompute_ratio=0.15)
            ids = [prefill.chunk_id(c) for c in chunks]
            for cid in ids:
                put.put(cid, prefill.export_chunk(cid), model_fingerprint=prefill.fingerprint)
            payload = h.to_bytes()
            for way in (("engine", "restaged") if r % 2 == 0 else ("restaged", "engine")):
                decode.cache.clear()
                decode.release(decode.import_handoff(h, fetch=fetch))          # every chunk held when prepared
                prepared = prepare(ReceivedHandoff(pb.HandoffHeader(request_id=f"r{r}", kind="engine"), payload),
                                   decode, store)
                assert not prepared.fetched and decode.cache.drop(ids) == len(ids)     # then evicted
                if way == "restaged":
                    t0 = time.perf_counter()
                    got = fetch_more(prepared, prepared.unstaged(decode.cache), decode, store)
                    times["helper"].append(time.perf_counter() - t0)
                    assert got == len(ids), f"the helper read {got} of {len(ids)} chunks"

                    def from_memory(cid, fetched=prepared.fetched):
                        return iter(fetched[cid]) if cid in fetched else None
                    t0 = time.perf_counter()
                    seq = decode.import_handoff(prepared.handoff, fetch=from_memory, layout=prepared.layout)
                else:
                    t0 = time.perf_counter()
                    seq = decode.import_handoff(prepared.handoff, fetch=fetch, layout=prepared.layout)
                times[way].append(time.perf_counter() - t0)
                decode.release(seq)
        store.close()
        put.close()
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)

    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": "cpu", "commit": commit,
              "command": " ".join(sys.argv), "requests": args.requests, "chunks": args.chunks,
              "chunk_tokens": args.chunk_tokens, "layers": args.layers,
              "engine_thread_ms_median": {"engine": med["engine"], "restaged": med["restaged"]},
              "helper_ms_median": med["helper"], "ms": {k: [1e3 * x for x in v] for k, v in times.items()}}
    print(f"engine thread, an admission of {args.chunks} evicted chunks: read there {med['engine']:.2f} ms, "
          f"read by a helper first {med['restaged']:.2f} ms ({med['engine'] / med['restaged']:.2f}x less); "
          f"the helper's read {med['helper']:.2f} ms (medians of {args.requests})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
