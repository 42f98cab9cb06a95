"""Store reads from another host's store over NIXL against the gRPC stream, on loopback (issue #23).

A store shard (`tessera kvstore serve --nixl`, its own process) keeps N chunks in its DRAM arena in /dev/shm; a client
that does not name the store's host reads each chunk whole, checked, into its own memory, by both paths in turn:
- `nixl`: the `Get` answers with where the layers lie; the client reads them and the extent's header over NIXL (UCX)
  into a registered staging buffer, checks the generation and each layer's CRC-32, and copies them out;
- `stream`: the same chunk over the gRPC stream (the store's frames, checked on receipt).
Peer in the same run: a plain host memcpy of the chunk's bytes (what moving them within one process costs).

    python3 bench/kvstore/store_nixl.py --chunks 8 --mib 32 --json bench/kvstore/DATE_DEVICE_COMMIT_store_nixl.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench" / "kvstore"))

from store_to_gpu import paths_table, start_store, write_result  # noqa: E402 - the bench's own pieces


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--mib", type=int, default=32, help="a chunk's K and V bytes (32 layers)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch

    from services.kvstore.client import KVStoreClient

    layers, heads, dim = 32, 8, 128
    tokens = max(1, (args.mib << 20) // (layers * 2 * heads * dim * 2))
    g = torch.Generator().manual_seed(0)
    chunks = {f"chunk-{i:03d}": [(torch.randn(tokens, heads, dim, generator=g).to(torch.bfloat16),
                                  torch.randn(tokens, heads, dim, generator=g).to(torch.bfloat16))
                                 for _ in range(layers)] for i in range(args.chunks)}
    chunk_bytes = layers * 2 * tokens * heads * dim * 2
    work = Path(tempfile.mkdtemp(prefix="tessera-bench-"))
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else str(work)
    proc, address = start_store((args.chunks + 2) * chunk_bytes, work, os.path.join(shm, f"tessera-bench-nixl-{os.getpid()}"),
                                extra=("--nixl",))
    rows: dict[str, list[float]] = {"nixl": [], "stream": [], "memcpy": []}
    try:
        with KVStoreClient(address, timeout=120) as writer:
            for cid, kv in chunks.items():
                writer.put(cid, kv)
        readers = {"nixl": KVStoreClient(address, timeout=120, nixl=True), "stream": KVStoreClient(address, timeout=120)}
        for path, reader in readers.items():
            list(reader.get("chunk-000"))       # warm: the connection, NIXL's peer and staging buffer
            for _ in range(args.rounds):
                for cid in chunks:
                    t0 = time.perf_counter()
                    got = list(reader.get(cid))
                    rows[path].append(time.perf_counter() - t0)
                    assert len(got) == layers
        nixl = readers["nixl"]
        assert nixl.reads["nixl"] > 0 and not nixl.nixl_unavailable, (nixl.reads, nixl.nixl_unavailable)
        flat = torch.cat([torch.cat([k.reshape(-1), v.reshape(-1)]) for k, v in chunks["chunk-000"]])
        for _ in range(args.rounds * args.chunks):
            t0 = time.perf_counter()
            flat.clone()
            rows["memcpy"].append(time.perf_counter() - t0)
        for reader in readers.values():
            reader.close()
    finally:
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(work, ignore_errors=True)
    table = paths_table(rows, chunk_bytes)
    ratio = table["stream"]["ms_p50"] / table["nixl"]["ms_p50"]
    print(f"nixl is {ratio:.2f}x faster than the stream")
    write_result(args.json, device=f"CPU ({os.cpu_count()} cores)", chunk_bytes=chunk_bytes, chunks=args.chunks,
                 rounds=args.rounds, paths=table, stream_over_nixl=ratio, samples_s=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
