"""What mutual TLS costs the store's bulk path: one store shard on loopback (DRAM tier), Llama-3-8B-sized
chunks (32 layers x K,V [512, 8, 128] bf16 = 64 MiB), whole-chunk Get GB/s for one stream and 4 concurrent
streams, and Put GB/s for one stream, with the cluster's mutual TLS off and on, alternating in one process.
Each figure is the median of ``--rounds`` rounds. GB = 1e9 bytes.

    python3 bench/store_tls/store_tls.py [--rounds 5] [--out bench/store_tls/RESULT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from services.cluster.security import ClusterTLS, mint  # noqa: E402
from services.kvstore import BackgroundServer, KVStoreClient, StoreConfig  # noqa: E402

SHAPE = dict(layers=32, tokens=512, heads=8, dim=128)


def chunk(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    t = (SHAPE["tokens"], SHAPE["heads"], SHAPE["dim"])
    return [(torch.randn(t, generator=g).bfloat16(), torch.randn(t, generator=g).bfloat16())
            for _ in range(SHAPE["layers"])]


def nbytes(layers) -> int:
    return sum(k.numel() * 2 + v.numel() * 2 for k, v in layers)


def measure(tls_dir: str | None, layers, streams: int) -> dict[str, float]:
    """One round with TLS on (``tls_dir``) or off: put GB/s (one stream), get GB/s (1 and ``streams``)."""
    store_tls = ClusterTLS.load(tls_dir, "store") if tls_dir else None
    prefill_tls = ClusterTLS.load(tls_dir, "prefill") if tls_dir else None
    size = nbytes(layers)
    with BackgroundServer(StoreConfig(dram_bytes=8 << 30), tls=store_tls) as srv:
        clients = [KVStoreClient(srv.address, timeout=300, tls=prefill_tls) for _ in range(streams)]
        try:
            ids = [f"{i:064x}" for i in range(streams)]
            t0 = time.perf_counter()
            for cid in ids:
                clients[0].put(cid, layers)
            put = size * len(ids) / (time.perf_counter() - t0) / 1e9
            t0 = time.perf_counter()
            for _ in clients[0].get(ids[0]):
                pass
            one = size / (time.perf_counter() - t0) / 1e9

            def read(c, cid):
                for _ in c.get(cid):
                    pass
            threads = [threading.Thread(target=read, args=(c, cid)) for c, cid in zip(clients, ids)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            many = size * streams / (time.perf_counter() - t0) / 1e9
        finally:
            for c in clients:
                c.close()
    return {"put_GBps": put, "get_GBps": one, f"get_{streams}_streams_GBps": many}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--out", help="write the results here (JSON)")
    args = ap.parse_args()
    layers = chunk(0)
    certs = str(mint(Path(tempfile.mkdtemp(prefix="tessera-certs-"))))
    rows: dict[str, list[dict]] = {"off": [], "on": []}
    for r in range(args.rounds):
        for setting in ("off", "on"):
            rows[setting].append(measure(certs if setting == "on" else None, layers, args.streams))
            print(f"round {r} {setting}: " + ", ".join(f"{k} {v:.2f}" for k, v in rows[setting][-1].items()), flush=True)
    med = {s: {k: statistics.median(x[k] for x in rows[s]) for k in rows[s][0]} for s in rows}
    print("\n| 64 MiB chunk, GB/s (median) | TLS off | TLS on | on / off |\n|---|---:|---:|---:|")
    for k in med["off"]:
        print(f"| {k} | {med['off'][k]:.2f} | {med['on'][k]:.2f} | {med['on'][k] / med['off'][k]:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                              "commit": os.environ.get("TESSERA_COMMIT", ""), "cpus": os.cpu_count(),
                                              "chunk_bytes": nbytes(layers), "rounds": rows, "median": med}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
