"""KV store benchmark: Llama-3-8B-sized chunks (512 tokens: 32 layers x K,V [512, 8, 128] bf16 = 64 MiB).

Per tier, through a `tessera kvstore serve` process on loopback: time to first layer and whole-chunk
GB/s for one stream and for 4 concurrent streams; beside them, in the same run, the raw medium:
memcpy for DRAM, a sequential read of a file on the RocksDB disk (page cache dropped, then warm),
and the ceiling of a bare Python gRPC stream of the same bytes (no store, no checksums).

    .venv/bin/python bench/kvstore.py [--chunks 4] [--workdir /var/tmp/tessera-kvbench]

Writes bench/kvstore.json (bench/kvstore.md discusses it). GB = 1e9 bytes. Dropping the page cache needs root;
without it the "cold" rows are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.kvstore import KVStoreClient  # noqa: E402

GB = 1e9


def chunk_layers(seed: int, layers: int, tokens: int, heads: int, dim: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(tokens, heads, dim, generator=g).to(torch.bfloat16),
             torch.randn(tokens, heads, dim, generator=g).to(torch.bfloat16)) for _ in range(layers)]


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def start_server(args, rocksdb_dir: Path, dram_bytes: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "kvstore", "serve", "--port", "0", "--dram-bytes", str(dram_bytes),
         "--rocksdb-dir", str(rocksdb_dir), "--rocksdb-bytes", str(64 << 30), "--log-level", "WARNING"],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("kvstore listening on"):
        proc.kill()
        raise RuntimeError(f"store did not start: {line!r}")
    return proc, line.split()[3]


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)


def timed_get(client: KVStoreClient, chunk_id: str) -> tuple[float, float, int]:
    """(seconds to first layer, seconds for the whole chunk, bytes) of one get on the client."""
    t0 = time.perf_counter()
    first, nbytes = None, 0
    for _, k, v in client.get(chunk_id):
        if first is None:
            first = time.perf_counter() - t0
        nbytes += k.numel() * k.element_size() + v.numel() * v.element_size()
    return first, time.perf_counter() - t0, nbytes


def concurrent_gets(address: str, chunk_ids: list[str]) -> float:
    """Aggregate GB/s of one get per chunk id, all at once, one client (channel) per stream."""
    clients = [KVStoreClient(address, timeout=300) for _ in chunk_ids]
    results = [0] * len(chunk_ids)
    barrier = threading.Barrier(len(chunk_ids) + 1)

    def run(i: int) -> None:
        barrier.wait()
        results[i] = timed_get(clients[i], chunk_ids[i])[2]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(chunk_ids))]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for c in clients:
        c.close()
    return sum(results) / wall / GB


def tier_row(name: str, singles: list[tuple[float, float, int]], conc: float | None) -> dict:
    return {
        "tier": name,
        "first_layer_ms_median": 1e3 * float(np.median([s[0] for s in singles])),
        "one_stream_GBps_median": float(np.median([s[2] / s[1] / GB for s in singles])),
        "four_streams_GBps": conc,
        "samples": len(singles),
        "one_stream_seconds": [round(s[1], 4) for s in singles],
    }


# ---- raw peers ----------------------------------------------------------------------------
def memcpy_GBps(nbytes: int, reps: int = 5) -> dict:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t0 = time.perf_counter()
    for _ in range(reps):
        np.copyto(dst, src)
    hot = nbytes * reps / (time.perf_counter() - t0) / GB
    t0 = time.perf_counter()
    for _ in range(reps):
        bytes(src.data)                      # a fresh buffer each time: page faults included
    fresh = nbytes * reps / (time.perf_counter() - t0) / GB
    return {"memcpy_GBps": hot, "memcpy_fresh_alloc_GBps": fresh}


def seq_read_GBps(path: Path, nbytes: int, cold: bool) -> float:
    with open(path, "wb") as f:
        block = np.random.default_rng(1).integers(0, 255, 8 << 20, dtype=np.uint8).tobytes()
        for _ in range(nbytes // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    if cold:
        drop_page_cache()
    else:
        path.read_bytes()
    buf = memoryview(bytearray(4 << 20))
    fd = os.open(path, os.O_RDONLY)
    t0 = time.perf_counter()
    total = 0
    while (n := os.readv(fd, [buf])) > 0:
        total += n
    os.close(fd)
    return total / (time.perf_counter() - t0) / GB


def grpc_ceiling(nbytes: int, frame: int, reps: int) -> float:
    """GB/s of a bare Python gRPC server stream of ``nbytes`` in ``frame``-byte messages, loopback,
    server in another process, no protobuf framing or checksums: what the transport alone gives."""
    proc = subprocess.Popen([sys.executable, __file__, "_raw_grpc_server", str(nbytes), str(frame)],
                            stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 8 << 20)]) as ch:
        call = ch.unary_stream("/raw/Stream", request_serializer=None, response_deserializer=None)
        rates = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            got = sum(len(m) for m in call(b"", timeout=60))
            rates.append(got / (time.perf_counter() - t0) / GB)
    proc.terminate()
    proc.wait(10)
    return float(np.median(rates[1:]))


def _raw_grpc_server(nbytes: int, frame: int) -> None:
    import asyncio

    import grpc

    payload = [os.urandom(frame) for _ in range(nbytes // frame)]

    async def stream(request, context):
        for p in payload:
            yield p

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.max_send_message_length", 8 << 20)])
        handler = grpc.method_handlers_generic_handler("raw", {"Stream": grpc.unary_stream_rpc_method_handler(stream)})
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=4, help="chunks per measurement (>= 4 for the concurrent row)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--workdir", default="/var/tmp/tessera-kvbench", help="RocksDB directory's parent (the disk measured)")
    p.add_argument("--out", default=str(REPO / "bench" / "kvstore.json"))
    args = p.parse_args()
    if args.chunks < 4:
        raise SystemExit("--chunks must be >= 4")
    from rich.console import Console

    console = Console(stderr=True)
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shape = (args.layers, args.tokens, args.kv_heads, args.head_dim)
    with console.status("building chunks"):
        chunks = {f"bench{i:02d}": chunk_layers(i, *shape) for i in range(args.chunks * 2)}
    chunk_bytes = sum(k.numel() * 2 + v.numel() * 2 for k, v in next(iter(chunks.values())))
    rows, peers = [], {}

    # DRAM: every chunk fits; gets are served from DRAM.
    proc, address = start_server(args, work / "db-dram", dram_bytes=(args.chunks + 1) * chunk_bytes)
    try:
        c = KVStoreClient(address, timeout=300)
        ids = list(chunks)[: args.chunks]
        put_rates = []
        for cid in ids:
            t0 = time.perf_counter()
            c.put(cid, chunks[cid])
            put_rates.append(chunk_bytes / (time.perf_counter() - t0) / GB)
        console.log(f"put (write-through DRAM+RocksDB) median {np.median(put_rates):.2f} GB/s")
        timed_get(c, ids[0])   # warm-up: connections, allocator
        singles = [timed_get(c, cid) for cid in ids]
        conc = concurrent_gets(address, ids[:4])
        rows.append(tier_row("dram", singles, conc))
        console.log(rows[-1])
        c.close()
    finally:
        stop_server(proc)

    # RocksDB: DRAM holds one chunk, so each get of a chunk not read just before comes from RocksDB
    # (the hit promotes it into DRAM, evicting the previous one, which is still on RocksDB).
    proc, address = start_server(args, work / "db-rocks", dram_bytes=chunk_bytes)
    try:
        c = KVStoreClient(address, timeout=300)
        ids = list(chunks)
        for cid in ids:
            c.put(cid, chunks[cid])
        cold_ok = drop_page_cache()
        order = ids[: args.chunks]
        singles_cold = [timed_get(c, cid) for cid in order]
        cold_conc = None
        if cold_ok:
            drop_page_cache()
            cold_conc = concurrent_gets(address, ids[args.chunks: args.chunks + 4])
            rows.append(tier_row("rocksdb (page cache dropped)", singles_cold, cold_conc))
            console.log(rows[-1])
        # warm page cache: read the same chunks again, each from RocksDB (DRAM holds only the last one)
        warm_ids = ids[args.chunks: args.chunks * 2]
        for cid in warm_ids:
            timed_get(c, cid)
        singles_warm = [timed_get(c, cid) for cid in ids[: args.chunks]]
        warm_conc = concurrent_gets(address, ids[args.chunks: args.chunks + 4])
        rows.append(tier_row("rocksdb (page cache warm)", singles_warm, warm_conc))
        console.log(rows[-1])
        tiers = [t.tier for t in c.stats().tiers]
        stats = {int(t.tier): (t.hits, t.misses) for t in c.stats().tiers}
        console.log(f"tier hits/misses {stats} over tiers {tiers}")
        c.close()
    finally:
        stop_server(proc)

    with console.status("raw peers"):
        peers.update(memcpy_GBps(chunk_bytes))
        peers["disk_seq_read_cold_GBps"] = seq_read_GBps(work / "seq.bin", 512 << 20, cold=True) if drop_page_cache() else None
        peers["disk_seq_read_warm_GBps"] = seq_read_GBps(work / "seq.bin", 512 << 20, cold=False)
        peers["grpc_python_stream_ceiling_GBps"] = grpc_ceiling(chunk_bytes, 1 << 20, reps=4)
    console.log(peers)
    shutil.rmtree(work, ignore_errors=True)

    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; {_cpu_model()}",
        "chunk": {"layers": args.layers, "k_v_shape": list(shape[1:]), "dtype": "bfloat16", "bytes": chunk_bytes},
        "frame_bytes": 1 << 20,
        "put_GBps_median": float(np.median(put_rates)),
        "tiers": rows,
        "peers": peers,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    console.log(f"wrote {args.out}")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "_raw_grpc_server":
        _raw_grpc_server(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
