"""KV store benchmark: Llama-3-8B-sized chunks (512 tokens: 32 layers x K,V [512, 8, 128] bf16 = 64 MiB).

Per tier, through a `tessera kvstore serve` process on loopback: time to first layer and whole-chunk
GB/s for one stream and for 4 concurrent streams; beside them, in the same round, the raw medium:
memcpy for DRAM, a sequential read of a file on the RocksDB disk (page cache dropped, then warm),
the ceiling of a bare Python gRPC stream of the same bytes (no store, no checksums), and the
RocksDB tier's read path alone (in process, no gRPC). Puts: one stream (chunks one after another)
and 4 concurrent streams into a fresh store, write-behind (acknowledged from DRAM, as the cluster's
store runs) and write-through (DRAM and RocksDB before the acknowledgement). Every figure is
measured once per round; ratios are taken within a round, then the median over rounds is reported.

    .venv/bin/python bench/kvstore/kvstore.py [--chunks 4] [--workdir /var/tmp/tessera-kvbench] [--puts-only]

With ``--register-docs N`` it measures corpus registration end to end instead: a local cluster
(services/launch/local.py: one store shard, write-behind, one prefill and one decode worker, each
with a host tier) on the CPU with a tiny model whose KV per token is Llama-3-8B's (32 layers x 8 KV
heads x 128, fp32 here: 128 MiB per 512-token chunk, ``--kv-layers`` to change), and N documents of
512 tokens registered through the gateway's RegisterChunks, 8 per call as bench/cluster/cluster.py does.

Writes bench/kvstore/kvstore.json (bench/kvstore/README.md discusses it; a result kept is named by date, device and commit). GB = 1e9 bytes. Dropping the page cache needs root;
without it the "cold" rows are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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

REPO = Path(__file__).resolve().parents[2]
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


def start_server(rocksdb_dir: Path, dram_bytes: int, write_mode: str = "through") -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "kvstore", "serve", "--port", "0", "--dram-bytes", str(dram_bytes),
         "--rocksdb-dir", str(rocksdb_dir), "--rocksdb-bytes", str(64 << 30), "--write-mode", write_mode,
         "--log-level", "WARNING"],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("kvstore listening on"):
        proc.kill()
        raise RuntimeError(f"store did not start: {line!r}")
    return proc, line.split()[3]


def settle() -> None:
    """After puts: let RocksDB flush its memtable and the kernel write the dirty pages back, so
    that gets are timed against a store at rest, not against the tail of the writes."""
    time.sleep(2)
    os.sync()
    time.sleep(1)


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


def _at_once(address: str, calls: list) -> float:
    """Aggregate GB/s of ``call(client) -> bytes moved`` for every call, all started together behind a
    barrier, one client (channel) each."""
    clients = [KVStoreClient(address, timeout=300) for _ in calls]
    results = [0] * len(calls)
    barrier = threading.Barrier(len(calls) + 1)

    def run(i: int) -> None:
        barrier.wait()
        results[i] = calls[i](clients[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for c in clients:
        c.close()
    if not all(results):
        raise RuntimeError("a concurrent call did not complete")
    return sum(results) / wall / GB


def concurrent_gets(address: str, chunk_ids: list[str]) -> float:
    """Aggregate GB/s of one get per chunk id, all at once, one client (channel) per stream."""
    return _at_once(address, [lambda c, cid=cid: timed_get(c, cid)[2] for cid in chunk_ids])


def concurrent_puts(address: str, puts: list[tuple[str, list]]) -> float:
    """Aggregate GB/s of one put per (chunk id, layers), all at once, one client (channel) per stream."""
    return _at_once(address, [lambda c, p=p: c.put(*p).nbytes for p in puts])


def put_row(work: Path, chunks: dict, chunk_bytes: int, n: int, write_mode: str, tag: str) -> dict:
    """Puts into a fresh store (DRAM and RocksDB, ``write_mode``), as the cluster's store runs
    (DRAM large enough for every chunk): ``n`` puts one after another on one stream (wall time
    from the first call to the last acknowledgement), then 4 puts at once (4 streams); server and
    client CPU per chunk over the single stream. Chunk ids are fresh: no put replaces a chunk."""
    ids = list(chunks)
    proc, address = start_server(work / f"db-put-{tag}", dram_bytes=(n + 8) * chunk_bytes, write_mode=write_mode)
    try:
        with KVStoreClient(address, timeout=300) as c:
            c.put("warmup", chunks[ids[0]][:1])             # connection, allocator
            s0, c0 = process_cpu_seconds(proc.pid), process_cpu_seconds()
            t0 = time.perf_counter()
            times = []
            for cid in ids[:n]:
                t1 = time.perf_counter()
                c.put(f"one-{cid}", chunks[cid])
                times.append(time.perf_counter() - t1)
            wall = time.perf_counter() - t0
            server, client = process_cpu_seconds(proc.pid) - s0, process_cpu_seconds() - c0
            settle()          # write-behind: let the queue drain before the concurrent puts
            four = concurrent_puts(address, [(f"four-{cid}", chunks[cid]) for cid in ids[:4]])
    finally:
        stop_server(proc)
        shutil.rmtree(work / f"db-put-{tag}", ignore_errors=True)
    return {"write_mode": write_mode, "one_stream_GBps": n * chunk_bytes / wall / GB, "four_streams_GBps": four,
            "put_ms": [round(1e3 * t, 1) for t in times],
            "server_cpu_ms_per_chunk": 1e3 * server / n, "client_cpu_ms_per_chunk": 1e3 * client / n}


def process_cpu_seconds(pid: int | None = None) -> float:
    """User+system CPU seconds of a process, all its threads (this one when pid is None)."""
    if pid is None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_timed(pid: int, fn) -> tuple[list, float, float]:
    """(fn's result, server CPU s, client CPU s) spent while fn ran."""
    s0, c0 = process_cpu_seconds(pid), process_cpu_seconds()
    out = fn()
    return out, process_cpu_seconds(pid) - s0, process_cpu_seconds() - c0


def tier_row(name: str, singles: list[tuple[float, float, int]], conc: list[float], cpu: tuple[float, float] | None = None) -> dict:
    """``cpu``: (server, client) CPU seconds over the single-stream gets. On a shared host wall
    time depends on the neighbours; CPU time per chunk much less, and 1 / max(server, client)
    is what one stream would reach with a core to each side."""
    per_chunk = None if cpu is None else (cpu[0] / len(singles), cpu[1] / len(singles))
    return {
        "tier": name,
        "server_cpu_ms_per_chunk": None if cpu is None else 1e3 * per_chunk[0],
        "client_cpu_ms_per_chunk": None if cpu is None else 1e3 * per_chunk[1],
        "cpu_bound_one_stream_GBps": None if cpu is None else singles[0][2] / max(per_chunk) / GB,
        "first_layer_ms_median": 1e3 * float(np.median([s[0] for s in singles])),
        "one_stream_GBps_median": float(np.median([s[2] / s[1] / GB for s in singles])),
        "four_streams_GBps_median": float(np.median(conc)) if conc else None,
        "one_stream_seconds": [round(s[1], 4) for s in singles],
        "four_streams_GBps": [round(x, 3) for x in conc],
    }


def in_process_tier_reads(work: Path, chunks: dict, cold: bool) -> float:
    """GB/s of the RocksDB tier read path alone (read + read-ahead + crc32 check of every layer,
    no gRPC): ``TieredStore`` sessions in this process, one chunk after another."""
    import asyncio

    from services.kvstore.config import StoreConfig
    from services.kvstore.store import TieredStore

    async def run() -> float:
        chunk_bytes = sum(k.numel() * 2 + v.numel() * 2 for k, v in next(iter(chunks.values())))
        store = TieredStore(StoreConfig(dram_bytes=chunk_bytes, rocksdb_dir=str(work / "db-inproc"), rocksdb_bytes=64 << 30))
        await store.start()
        from services.kvstore.client import _raw
        from services.kvstore.chunk import ChunkMeta, checksum
        from services.rpc import kvstore_pb2 as pb

        ids = list(chunks)[:4]
        for cid in ids:
            layers = tuple(_raw(k).tobytes() + _raw(v).tobytes() for k, v in chunks[cid])
            k0 = chunks[cid][0][0]
            meta = ChunkMeta(cid, "", "bfloat16", tuple(tuple(k.shape) for k, _ in chunks[cid]),
                             tuple(tuple(v.shape) for _, v in chunks[cid]), tuple(checksum(x) for x in layers))
            await store.put(meta, layers)
        assert k0.dtype == torch.bfloat16
        await asyncio.to_thread(store.slots[1].storage._db.flush)   # read blob files, not the memtable
        if cold:
            drop_page_cache()
        t0, total = time.perf_counter(), 0
        for cid in ids[:3]:                       # the 4th is the one DRAM holds
            session = await store.open_read(cid)
            assert session.tier == pb.TIER_ROCKSDB
            n = session.meta.num_layers
            for i in range(n):
                await session.layer(i, n)
            session.abort()
            total += session.meta.nbytes
        rate = total / (time.perf_counter() - t0) / GB
        await store.close()
        return rate

    return asyncio.run(run())


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


def measure_round(work: Path, chunks: dict, chunk_bytes: int, n: int, r: int, console, puts_only: bool = False) -> dict:
    """One round of every measurement, stores and peers back to back (the host is shared, so
    a ratio is only meaningful between figures of the same round)."""
    out: dict = {"loadavg_1min": os.getloadavg()[0]}
    ids = list(chunks)
    if puts_only:
        out["put_behind"] = put_row(work, chunks, chunk_bytes, n, "behind", f"behind-{r}")
        settle()
        out["put_through"] = put_row(work, chunks, chunk_bytes, n, "through", f"through-{r}")
        return out
    proc, address = start_server(work / f"db-dram-{r}", dram_bytes=(n + 1) * chunk_bytes)
    try:
        with KVStoreClient(address, timeout=300) as c, KVStoreClient(address, timeout=300, verify=False) as nv:
            for cid in ids[:n]:
                c.put(cid, chunks[cid])
            settle()
            timed_get(c, ids[0])                          # warm-up: connection, allocator
            singles, *cpu = cpu_timed(proc.pid, lambda: [timed_get(c, cid) for cid in ids[:n]])
            out["dram"] = tier_row("dram", singles, [concurrent_gets(address, ids[:4])], cpu)
            singles, *cpu = cpu_timed(proc.pid, lambda: [timed_get(nv, cid) for cid in ids[:n]])
            out["dram_client_verify_off"] = tier_row("dram, client check off", singles, [], cpu)
    finally:
        stop_server(proc)
    # RocksDB: DRAM holds one chunk, so a get of any chunk but the last one read comes from
    # RocksDB (the hit promotes it into DRAM, evicting the previous one, still on RocksDB).
    proc, address = start_server(work / f"db-rocks-{r}", dram_bytes=chunk_bytes)
    try:
        with KVStoreClient(address, timeout=300) as c:
            for cid in ids:
                c.put(cid, chunks[cid])
            settle()
            first, second = ids[:n], ids[n:n + 4]
            if drop_page_cache():
                cold, *cpu = cpu_timed(proc.pid, lambda: [timed_get(c, cid) for cid in first])
                drop_page_cache()
                out["rocksdb_cold"] = tier_row("rocksdb, page cache dropped", cold, [concurrent_gets(address, second)], cpu)
            for cid in first + second:
                timed_get(c, cid)                        # page cache now holds every chunk
            warm, *cpu = cpu_timed(proc.pid, lambda: [timed_get(c, cid) for cid in first])
            out["rocksdb_warm"] = tier_row("rocksdb, page cache warm", warm, [concurrent_gets(address, second)], cpu)
            hits = {t.tier: t.hits for t in c.stats().tiers}
            out["rocksdb_tier_hits"] = hits.get(2, 0)
    finally:
        stop_server(proc)
    out["put_behind"] = put_row(work, chunks, chunk_bytes, n, "behind", f"behind-{r}")
    settle()
    out["put_through"] = put_row(work, chunks, chunk_bytes, n, "through", f"through-{r}")
    shutil.rmtree(work / f"db-dram-{r}", ignore_errors=True)
    shutil.rmtree(work / f"db-rocks-{r}", ignore_errors=True)
    out["inproc_rocksdb_cold_GBps"] = in_process_tier_reads(work, chunks, cold=True)
    out["inproc_rocksdb_warm_GBps"] = in_process_tier_reads(work, chunks, cold=False)
    shutil.rmtree(work / "db-inproc", ignore_errors=True)
    out.update(memcpy_GBps(chunk_bytes))
    out["disk_seq_read_cold_GBps"] = seq_read_GBps(work / "seq.bin", 1 << 30, cold=True)
    out["disk_seq_read_warm_GBps"] = seq_read_GBps(work / "seq.bin", 1 << 30, cold=False)
    (work / "seq.bin").unlink()
    out["grpc_python_stream_ceiling_GBps"] = grpc_ceiling(chunk_bytes, 1 << 20, reps=3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=4, help="chunks per single-stream measurement (>= 4)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every measurement; medians are reported")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--workdir", default="/var/tmp/tessera-kvbench", help="where RocksDB lives (the disk measured)")
    p.add_argument("--out", default=str(REPO / "bench" / "kvstore" / "kvstore.json"))
    p.add_argument("--puts-only", action="store_true", help="measure the put rows only (a quick before/after)")
    p.add_argument("--register-docs", type=int, help="measure corpus registration through a local cluster instead")
    p.add_argument("--kv-layers", type=int, default=32, help="--register-docs: layers of the tiny model")
    args = p.parse_args()
    if args.register_docs is not None:
        if args.register_docs < 1 or args.kv_layers < 1:
            raise SystemExit("--register-docs and --kv-layers must be >= 1")
        out = Path(args.out) if args.out != p.get_default("out") else None     # the default file keeps the store's rows
        register_corpus(args.register_docs, args.kv_layers, 8, out)
        return
    if args.chunks < 4 or args.rounds < 1:
        raise SystemExit("--chunks must be >= 4 and --rounds >= 1")
    if not drop_page_cache():
        print("warning: cannot drop the page cache (needs root): cold rows are skipped", file=sys.stderr)
    from rich.console import Console

    console = Console(stderr=True)
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shape = (args.layers, args.tokens, args.kv_heads, args.head_dim)
    with console.status("building chunks"):
        chunks = {f"bench{i:02d}": chunk_layers(i, *shape) for i in range(args.chunks + 4)}
    chunk_bytes = sum(k.numel() * 2 + v.numel() * 2 for k, v in next(iter(chunks.values())))
    rounds = []
    for r in range(args.rounds):
        with console.status(f"round {r + 1}/{args.rounds}"):
            rounds.append(measure_round(work, chunks, chunk_bytes, args.chunks, r, console, args.puts_only))
        if args.puts_only:
            console.log(f"round {r + 1}: put behind {rounds[-1]['put_behind']['one_stream_GBps']:.2f}, "
                        f"through {rounds[-1]['put_through']['one_stream_GBps']:.2f} GB/s, load {rounds[-1]['loadavg_1min']:.1f}")
            continue
        console.log(f"round {r + 1}: dram {rounds[-1]['dram']['one_stream_GBps_median']:.2f} GB/s, "
                    f"put behind {rounds[-1]['put_behind']['one_stream_GBps']:.2f}, "
                    f"through {rounds[-1]['put_through']['one_stream_GBps']:.2f} GB/s, "
                    f"grpc ceiling {rounds[-1]['grpc_python_stream_ceiling_GBps']:.2f} GB/s, load {rounds[-1]['loadavg_1min']:.1f}")
    shutil.rmtree(work, ignore_errors=True)

    def med(path) -> float | None:
        vals = []
        for r in rounds:
            try:
                vals.append(path(r))
            except KeyError:        # --puts-only: the get rows were not measured
                vals.append(None)
        vals = [v for v in vals if v is not None]
        return float(np.median(vals)) if vals else None

    summary = {
        "dram_one_stream_GBps": med(lambda r: r["dram"]["one_stream_GBps_median"]),
        "dram_four_streams_GBps": med(lambda r: r["dram"]["four_streams_GBps_median"]),
        "dram_first_layer_ms": med(lambda r: r["dram"]["first_layer_ms_median"]),
        "dram_client_check_off_one_stream_GBps": med(lambda r: r["dram_client_verify_off"]["one_stream_GBps_median"]),
        "rocksdb_cold_one_stream_GBps": med(lambda r: r.get("rocksdb_cold", {}).get("one_stream_GBps_median")),
        "rocksdb_cold_four_streams_GBps": med(lambda r: r.get("rocksdb_cold", {}).get("four_streams_GBps_median")),
        "rocksdb_cold_first_layer_ms": med(lambda r: r.get("rocksdb_cold", {}).get("first_layer_ms_median")),
        "rocksdb_warm_one_stream_GBps": med(lambda r: r["rocksdb_warm"]["one_stream_GBps_median"]),
        "rocksdb_warm_four_streams_GBps": med(lambda r: r["rocksdb_warm"]["four_streams_GBps_median"]),
        "rocksdb_warm_first_layer_ms": med(lambda r: r["rocksdb_warm"]["first_layer_ms_median"]),
        "inproc_rocksdb_cold_GBps": med(lambda r: r["inproc_rocksdb_cold_GBps"]),
        "inproc_rocksdb_warm_GBps": med(lambda r: r["inproc_rocksdb_warm_GBps"]),
        "dram_cpu_ms_per_chunk_server": med(lambda r: r["dram"]["server_cpu_ms_per_chunk"]),
        "dram_cpu_ms_per_chunk_client": med(lambda r: r["dram"]["client_cpu_ms_per_chunk"]),
        "dram_cpu_bound_one_stream_GBps": med(lambda r: r["dram"]["cpu_bound_one_stream_GBps"]),
        "dram_client_check_off_cpu_bound_GBps": med(lambda r: r["dram_client_verify_off"]["cpu_bound_one_stream_GBps"]),
        "rocksdb_cold_cpu_ms_per_chunk_server": med(lambda r: r.get("rocksdb_cold", {}).get("server_cpu_ms_per_chunk")),
        "rocksdb_warm_cpu_ms_per_chunk_server": med(lambda r: r["rocksdb_warm"]["server_cpu_ms_per_chunk"]),
        "rocksdb_warm_cpu_bound_one_stream_GBps": med(lambda r: r["rocksdb_warm"]["cpu_bound_one_stream_GBps"]),
        "put_behind_one_stream_GBps": med(lambda r: r["put_behind"]["one_stream_GBps"]),
        "put_behind_four_streams_GBps": med(lambda r: r["put_behind"]["four_streams_GBps"]),
        "put_behind_cpu_ms_per_chunk_server": med(lambda r: r["put_behind"]["server_cpu_ms_per_chunk"]),
        "put_behind_cpu_ms_per_chunk_client": med(lambda r: r["put_behind"]["client_cpu_ms_per_chunk"]),
        "put_through_one_stream_GBps": med(lambda r: r["put_through"]["one_stream_GBps"]),
        "put_through_four_streams_GBps": med(lambda r: r["put_through"]["four_streams_GBps"]),
        "put_through_cpu_ms_per_chunk_server": med(lambda r: r["put_through"]["server_cpu_ms_per_chunk"]),
        "put_through_cpu_ms_per_chunk_client": med(lambda r: r["put_through"]["client_cpu_ms_per_chunk"]),
        # ratios within each round, then the median over rounds
        "put_behind_over_dram_get": med(lambda r: r["put_behind"]["one_stream_GBps"] / r["dram"]["one_stream_GBps_median"]),
        "put_through_over_dram_get": med(lambda r: r["put_through"]["one_stream_GBps"] / r["dram"]["one_stream_GBps_median"]),
        "memcpy_GBps": med(lambda r: r["memcpy_GBps"]),
        "memcpy_fresh_alloc_GBps": med(lambda r: r["memcpy_fresh_alloc_GBps"]),
        "disk_seq_read_cold_GBps": med(lambda r: r["disk_seq_read_cold_GBps"]),
        "disk_seq_read_warm_GBps": med(lambda r: r["disk_seq_read_warm_GBps"]),
        "grpc_python_stream_ceiling_GBps": med(lambda r: r["grpc_python_stream_ceiling_GBps"]),
        # ratios within each round, then the median over rounds
        "dram_over_grpc_ceiling": med(lambda r: r["dram"]["one_stream_GBps_median"] / r["grpc_python_stream_ceiling_GBps"]),
        "rocksdb_cold_over_disk_cold": med(lambda r: r["rocksdb_cold"]["one_stream_GBps_median"] / r["disk_seq_read_cold_GBps"]
                                           if "rocksdb_cold" in r else None),
        "inproc_rocksdb_cold_over_disk_cold": med(lambda r: r["inproc_rocksdb_cold_GBps"] / r["disk_seq_read_cold_GBps"]),
    }
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": f"{_cpu_model()}, {os.cpu_count()} cores (shared host: other work ran meanwhile, see loadavg)",
        "chunk": {"layers": args.layers, "k_v_shape": list(shape[1:]), "dtype": "bfloat16", "bytes": chunk_bytes},
        "frame_bytes": 3 << 20,      # the client default: a 2 MiB layer travels whole, both ways
        "checksum": "crc32 (ISA-L when installed, zlib-compatible)",
        "summary": summary,
        "rounds": rounds,
        "command": " ".join(["python", "bench/kvstore/kvstore.py", *sys.argv[1:]]),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    console.log(json.dumps(summary, indent=1))
    console.log(f"wrote {args.out}")


def markdown_table(result: dict) -> str:
    """The summary of a result JSON as a markdown table (``bench/kvstore/kvstore.py --table FILE``)."""
    s = result["summary"]

    def f(x, unit=""):
        return "n/a" if x is None else f"{x:.2f}{unit}"
    rows = [
        ("DRAM tier (gRPC, client check on)", f(s["dram_first_layer_ms"], " ms"), f(s["dram_one_stream_GBps"]),
         f(s["dram_four_streams_GBps"]), f"memcpy {f(s['memcpy_GBps'])} (fresh pages {f(s['memcpy_fresh_alloc_GBps'])}); "
                                         f"bare Python gRPC stream {f(s['grpc_python_stream_ceiling_GBps'])}"),
        ("DRAM tier (gRPC, client check off)", "", f(s["dram_client_check_off_one_stream_GBps"]), "", ""),
        ("RocksDB tier, page cache dropped (gRPC)", f(s["rocksdb_cold_first_layer_ms"], " ms"), f(s["rocksdb_cold_one_stream_GBps"]),
         f(s["rocksdb_cold_four_streams_GBps"]), f"sequential file read, cache dropped {f(s['disk_seq_read_cold_GBps'])}"),
        ("RocksDB tier, page cache warm (gRPC)", f(s["rocksdb_warm_first_layer_ms"], " ms"), f(s["rocksdb_warm_one_stream_GBps"]),
         f(s["rocksdb_warm_four_streams_GBps"]), f"sequential file read, warm {f(s['disk_seq_read_warm_GBps'])}"),
        ("RocksDB read path alone, cache dropped (no gRPC)", "", f(s["inproc_rocksdb_cold_GBps"]), "", ""),
        ("RocksDB read path alone, warm (no gRPC)", "", f(s["inproc_rocksdb_warm_GBps"]), "", ""),
        ("put, write-behind (DRAM ack, as the cluster runs)", "", f(s.get("put_behind_one_stream_GBps")),
         f(s.get("put_behind_four_streams_GBps")), f"put / DRAM get, same round: {f(s.get('put_behind_over_dram_get'))}"),
        ("put, write-through (DRAM and RocksDB)", "", f(s.get("put_through_one_stream_GBps")),
         f(s.get("put_through_four_streams_GBps")), f"put / DRAM get, same round: {f(s.get('put_through_over_dram_get'))}"),
    ]
    out = ["| path | time to first layer | 1 stream GB/s | 4 streams GB/s (total) | raw medium, same rounds, GB/s |",
           "| --- | --- | --- | --- | --- |"]
    cpu = (f"CPU per 64 MiB chunk, DRAM tier: server {f(s['dram_cpu_ms_per_chunk_server'], ' ms')}, client "
           f"{f(s['dram_cpu_ms_per_chunk_client'], ' ms')}: one stream with a core per side would reach "
           f"{f(s['dram_cpu_bound_one_stream_GBps'])} GB/s ({f(s['dram_client_check_off_cpu_bound_GBps'])} with the client's "
           f"check off). RocksDB tier, warm: server {f(s['rocksdb_warm_cpu_ms_per_chunk_server'], ' ms')}, "
           f"{f(s['rocksdb_warm_cpu_bound_one_stream_GBps'])} GB/s; cache dropped: server "
           f"{f(s['rocksdb_cold_cpu_ms_per_chunk_server'], ' ms')}. Puts, server / client CPU per chunk: write-behind "
           f"{f(s.get('put_behind_cpu_ms_per_chunk_server'), ' ms')} / {f(s.get('put_behind_cpu_ms_per_chunk_client'), ' ms')}, "
           f"write-through {f(s.get('put_through_cpu_ms_per_chunk_server'), ' ms')} / "
           f"{f(s.get('put_through_cpu_ms_per_chunk_client'), ' ms')}.")
    out += [f"| {' | '.join(r)} |" for r in rows]
    return "\n".join(out) + "\n\n" + cpu


def register_corpus(docs: int, layers: int, batch: int, out: Path | None) -> dict:
    """Seconds to register ``docs`` 512-token documents through a local cluster's gateway (see the
    module docstring), per call and in all; also how long the prefill worker's store puts took."""
    import tempfile

    from services.cluster.config import ClusterConfig, DecodeSettings, PrefillSettings
    from services.launch.local import start_local_cluster
    from services.engine.model.tiny import write_tiny
    from services.sdk import Client

    tmp = Path(tempfile.mkdtemp(prefix="tessera-register-"))
    model = write_tiny(tmp / "model", num_layers=layers, num_heads=8, num_kv_heads=8, head_dim=128)
    chunk_bytes = layers * 2 * 512 * 8 * 128 * 4
    host = (docs + 8) * chunk_bytes
    cfg = ClusterConfig(model_dir=str(model), store_dir=str(tmp / "rocksdb"), store_dram_bytes=(docs + 8) * chunk_bytes,
                        kv_cache_bytes=4 * chunk_bytes, chunk_cache_bytes=2 * chunk_bytes,
                        prefill_settings=PrefillSettings(host_cache_bytes=host),
                        decode_settings=DecodeSettings(host_cache_bytes=host))
    cluster = start_local_cluster(cfg)
    rng = np.random.default_rng(0)
    corpus = [rng.integers(0, 256, 512).tolist() for _ in range(docs + batch)]
    try:
        with Client(cluster.gateway_address, timeout=1800) as client:
            client.register_chunks(corpus[docs:])             # warm-up: connections, first pass
            calls = []
            t0 = time.perf_counter()
            for i in range(0, docs, batch):
                t1 = time.perf_counter()
                got = client.register_chunks(corpus[i:i + batch])
                calls.append(time.perf_counter() - t1)
                if not all(c.stored for c in got):
                    raise RuntimeError(f"{sum(not c.stored for c in got)} chunk(s) not stored")
            total = time.perf_counter() - t0
    finally:
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "docs": docs, "batch": batch,
              "layers": layers, "chunk_bytes": chunk_bytes, "seconds": total, "seconds_per_doc": total / docs,
              "GBps": docs * chunk_bytes / total / GB, "call_seconds": [round(c, 3) for c in calls],
              "loadavg_1min": os.getloadavg()[0], "command": " ".join(["python", "bench/kvstore/kvstore.py", *sys.argv[1:]])}
    if out is not None:
        out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"registered {docs} documents ({chunk_bytes / 2**20:.0f} MiB of KV each) in {total:.2f} s: "
          f"{1e3 * total / docs:.0f} ms per document, {result['GBps']:.2f} GB/s; calls (s): {result['call_seconds']}")
    return result


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
    elif len(sys.argv) == 3 and sys.argv[1] == "--table":
        print(markdown_table(json.loads(Path(sys.argv[2]).read_text())))
    else:
        main()
