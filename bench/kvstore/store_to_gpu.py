"""A chunk from the KV store onto the GPU, against computing it there and against the host-to-device ceiling, all
measured in one run.

A store shard (`tessera kvstore serve`, its own process) keeps N Llama-3-8B chunks (32 layers x K, V of
[512, 8, 128] bf16 = 64 MiB each) in its DRAM tier. Per chunk, every layer read and copied to the GPU as the engine's
loader does (non-blocking copies, one sync at the end), timed from the get to the last byte on the device:
- `arena`: the tier in /dev/shm as segment files (the default), the client on the store's host viewing a chunk's
  layers in the segment it mapped and registered with CUDA once (timed after the registration; `arena_first`: the
  first read, while the segment is still being registered);
- `arena_gpu`: the same, the read copying each group of layers onto the GPU itself and checking their CRC-32 there
  (`get(device=)`, what a prefill worker's loads do);
- `arena_gpu_placed`: the same as a prefill worker reads it: one lookup of every chunk (a request's lookup, which
  gives each chunk its arena place; `lookup_per_chunk`: its time over the chunks), then each read from its place
  without a `Get` (timed alone); `arena_gpu_at_once`: the same as a prefill worker's pass reads it
  (`device_read`: every copy and check queued at once, then verified);
- `shm_file`: the tier in /dev/shm as a file per chunk (`--dram-segment-bytes 0`), read into pinned memory;
- `stream`: the same chunks streamed over loopback gRPC (the tier in the store's memory), as before;
- `*_x4`: the same reads four at a time on four threads, as a pass's chunk loads run (a chunk's share of the wall time);
- peers: the same bytes copied host to device from pinned memory, a copy per K and V (`h2d_pinned`) and as one
  64 MiB copy (`h2d_pinned_whole`; the faster of the two is the ceiling), and from pageable memory, and
  computing the chunk on the GPU (a `full` prefill of its 512 tokens and one more, random Llama-3-8B weights).

    python3 bench/kvstore/store_to_gpu.py --chunks 16 --json bench/kvstore/DATE_DEVICE_COMMIT_store_to_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

LAYERS, TOKENS, HEADS, DIM = 32, 512, 8, 128


def start_store(dram_bytes: int, work: Path, dram_dir: str | None, segment_bytes: int | None = None,
                extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """A store shard in its own process (``extra``: more ``kvstore serve`` flags); (the process, its address)."""
    cmd = [sys.executable, "-m", "services.cli", "kvstore", "serve", "--port", "0", "--dram-bytes", str(dram_bytes),
           "--rocksdb-dir", str(work / "db"), "--log-level", "WARNING", *extra]
    if dram_dir:
        cmd += ["--dram-dir", dram_dir]
    if segment_bytes is not None:
        cmd += ["--dram-segment-bytes", str(segment_bytes)]
    work.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
    for _ in range(50):             # NIXL (--nixl) logs a line or two first
        line = proc.stdout.readline()
        if line.startswith("kvstore listening on") or not line:
            break
    if not line.startswith("kvstore listening on"):
        proc.kill()
        raise RuntimeError(f"store did not start: {line!r}")
    return proc, line.split()[3]


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def load_seconds(client, chunk_id: str, dev, on_device: bool = False, place=None) -> float:
    """A chunk's get and copy onto ``dev``; ``place``: from the client's lookup (a worker's lookup of a request's
    chunks gives each its arena place), read from there without a Get."""
    _sync(dev)
    t0 = time.perf_counter()
    landed = [(k.to(dev, non_blocking=True), v.to(dev, non_blocking=True))
              for _, k, v in client.get(chunk_id, device=dev if on_device else None, place=place)]
    _sync(dev)
    seconds = time.perf_counter() - t0
    assert len(landed) == LAYERS
    return seconds


def at_once_seconds(client, chunk_id: str, place, dev) -> float:
    """A chunk read as a prefill worker's pass reads it (``device_read``): every copy and check queued at once,
    then verified; timed to the verified last byte on ``dev``."""
    _sync(dev)
    t0 = time.perf_counter()
    read = client.device_read(chunk_id, place, dev)
    landed = list(read)
    read.verify()
    _sync(dev)
    seconds = time.perf_counter() - t0
    assert len(landed) == LAYERS
    return seconds


def placed_seconds(client, chunk_ids: list[str], dev, rounds: int, read=load_seconds) -> tuple[list[float], list[float]]:
    """Reads from looked-up places: per round one lookup of every chunk (a request's lookup, which gives each chunk
    its arena place), then each chunk read from its place onto ``dev`` by ``read`` (``load_seconds``: the layer
    stream of ``get``; ``at_once_seconds``: as a prefill worker's pass reads it). (the reads' seconds, each round's
    lookup seconds per chunk)."""
    reads, lookups = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        places = {loc.chunk_id: loc.place for loc in client.lookup(chunk_ids)}
        lookups.append((time.perf_counter() - t0) / len(chunk_ids))
        assert all(p is not None for p in places.values()), "the lookup gave no arena place"
        reads += [read(client, cid, dev, True, places[cid]) if read is load_seconds else
                  read(client, cid, places[cid], dev) for cid in chunk_ids]
    return reads, lookups


def parallel_seconds(client, chunk_ids: list[str], dev, n: int, on_device: bool = False) -> list[float]:
    """``chunk_ids`` loaded ``n`` at a time on ``n`` threads (as a pass's chunk loads run): each group's wall time over
    ``n``, a chunk's share of the pipeline."""
    from concurrent.futures import ThreadPoolExecutor

    def one(cid):
        return [(k.to(dev, non_blocking=True), v.to(dev, non_blocking=True))
                for _, k, v in client.get(cid, device=dev if on_device else None)]

    out = []
    with ThreadPoolExecutor(n) as pool:
        for g in range(0, len(chunk_ids) - n + 1, n):
            _sync(dev)
            t0 = time.perf_counter()
            landed = list(pool.map(one, chunk_ids[g:g + n]))
            _sync(dev)
            out.append((time.perf_counter() - t0) / n)
            assert all(len(x) == LAYERS for x in landed)
    return out


def crc_seconds(layers, dev, reps: int) -> list[float]:
    """The CRC-32 of a chunk's 32 layers (K||V each) already on the GPU: one checksum launch, as an arena read does
    per group of layers; checked against zlib."""
    import zlib

    import torch

    from kernels.checksum import crc32_spans

    flat = torch.cat([torch.cat([k.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)]) for k, v in layers])
    n = flat.numel() // len(layers)
    data = flat.to(dev)
    starts, lengths = [i * n for i in range(len(layers))], [n] * len(layers)
    want = [zlib.crc32(flat[s:s + n].numpy().tobytes()) for s in starts]
    assert [c & 0xFFFFFFFF for c in crc32_spans(data, starts, lengths, backend="triton").tolist()] == want
    out = []
    for _ in range(reps):
        _sync(dev)
        t0 = time.perf_counter()
        crc32_spans(data, starts, lengths, backend="triton")
        _sync(dev)
        out.append(time.perf_counter() - t0)
    return out


def copy_seconds(tensors, dev, reps: int) -> list[float]:
    """``tensors`` copied onto ``dev``, non-blocking, one sync at the end."""
    out = []
    for _ in range(reps):
        _sync(dev)
        t0 = time.perf_counter()
        landed = [t.to(dev, non_blocking=True) for t in tensors]
        _sync(dev)
        out.append(time.perf_counter() - t0)
        del landed
    return out


def compute_seconds(model_dir: str | None, reps: int) -> tuple[list[float], str]:
    """A `full` prefill of 513 fresh random tokens (a chunk and one more) on the GPU, timed after two warm-ups."""
    import torch

    from services.engine import Engine

    tmp = None
    if model_dir is None:
        sys.path.insert(0, str(REPO / "bench" / "cluster"))
        import cluster

        tmp = tempfile.mkdtemp(prefix="tessera-model-")
        model_dir = str(cluster.write_random_llama(Path(tmp), LAYERS))
    eng = Engine.load(model_dir, device="cuda", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(reps + 2):
        tokens = torch.randint(1000, 100000, (TOKENS,), generator=g).tolist()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.prefill([tokens], [5], mode="full")
        torch.cuda.synchronize()
        if i >= 2:
            out.append(time.perf_counter() - t0)
    name = torch.cuda.get_device_name(0)
    del eng
    torch.cuda.empty_cache()
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    return out, name


def paths_table(rows: dict[str, list[float]], chunk_bytes: int, no_rate: tuple[str, ...] = ()) -> dict:
    """{path: ms p50, ms max, GB/s of a chunk (None for ``no_rate`` paths)} from each path's seconds, printed."""
    table = {}
    for k, v in rows.items():
        med = statistics.median(v)
        table[k] = {"ms_p50": med * 1e3, "ms_max": max(v) * 1e3,
                    "GBps": None if k in no_rate else chunk_bytes / med / 1e9}
        rate = f", {table[k]['GBps']:.2f} GB/s" if table[k]["GBps"] else ""
        print(f"{k:>16}: {table[k]['ms_p50']:.2f} ms p50 (max {table[k]['ms_max']:.2f}){rate}", flush=True)
    return table


def write_result(path: str | None, **fields) -> None:
    """The run's JSON (date, command, torch, commit, then ``fields``) at ``path``, when given."""
    import torch

    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
              "torch": torch.__version__, "commit": os.environ.get("TESSERA_COMMIT", ""), **fields}
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="reads of every chunk per path")
    ap.add_argument("--model-dir", help="a Llama-3-8B-shaped model to compute chunks with (default: random weights)")
    ap.add_argument("--device", default="cuda", help="cuda; cpu checks the script on a machine without a GPU "
                                                     "(no pinned memory, no compute peer)")
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch

    from services.kvstore.client import KVStoreClient

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    chunk_bytes = LAYERS * 2 * TOKENS * HEADS * DIM * 2
    g = torch.Generator().manual_seed(0)
    chunks = {f"chunk-{i:03d}": [(torch.randn(TOKENS, HEADS, DIM, generator=g).to(torch.bfloat16),
                                  torch.randn(TOKENS, HEADS, DIM, generator=g).to(torch.bfloat16))
                                 for _ in range(LAYERS)] for i in range(args.chunks)}
    work = Path(tempfile.mkdtemp(prefix="tessera-bench-"))
    shm = tempfile.mkdtemp(prefix="tessera-bench-dram-", dir="/dev/shm") if os.path.isdir("/dev/shm") else None
    rows = {}
    try:
        for path, segment_bytes in (("arena", None), ("shm_file", 0), ("stream", None)):
            dram_dir = os.path.join(shm, path) if shm and path != "stream" else None
            if path != "stream" and dram_dir is None:
                continue
            proc, address = start_store((args.chunks + 2) * chunk_bytes, work / path, dram_dir, segment_bytes)
            try:
                writer = KVStoreClient(address, timeout=120)
                for cid, layers in chunks.items():
                    writer.put(cid, layers)
                reader = KVStoreClient(address, timeout=120, local=path != "stream", pin=cuda)
                first = load_seconds(reader, "chunk-000", dev)   # warm: connections, the pinned allocator, the map
                if path == "arena":
                    rows["arena_first"] = [first]
                    t0 = time.perf_counter()
                    for seg in list(reader.segments._maps.values()):
                        if seg.registered is not None:
                            registered = seg.registered.result()
                            print(f"segment {os.path.basename(seg.path)} ({seg.size >> 20} MiB) registered: "
                                  f"{registered}, {1e3 * (time.perf_counter() - t0):.1f} ms after the first read")
                times = [load_seconds(reader, cid, dev) for _ in range(args.rounds) for cid in chunks]
                if path != "stream" and len(chunks) * args.rounds >= 4:
                    rows[f"{path}_x4"] = parallel_seconds(reader, list(chunks) * args.rounds, dev, 4)
                if path == "arena" and cuda:    # copied onto the GPU by the read and checked there
                    got = list(reader.get("chunk-000", device=dev))        # also the checksum kernel's compile
                    assert all(k.is_cuda and v.is_cuda for _, k, v in got), "layers fell back to the host path"
                    assert all(torch.equal(k.cpu(), chunks["chunk-000"][i][0]) and
                               torch.equal(v.cpu(), chunks["chunk-000"][i][1]) for i, k, v in got)
                    del got
                    rows["arena_gpu"] = [load_seconds(reader, cid, dev, True) for _ in range(args.rounds) for cid in chunks]
                    rows["arena_gpu_placed"], rows["lookup_per_chunk"] = placed_seconds(reader, list(chunks), dev,
                                                                                        args.rounds)
                    rows["arena_gpu_at_once"], _ = placed_seconds(reader, list(chunks), dev, args.rounds,
                                                                  at_once_seconds)
                    rows["arena_gpu_x4"] = parallel_seconds(reader, list(chunks) * args.rounds, dev, 4, True)
                assert (reader.local_reads > 0) == (path != "stream")
                assert (reader.arena_reads > 0) == (path == "arena")
                rows[path] = times
                writer.close()
                reader.close()
            finally:
                proc.terminate()
                proc.wait(60)
        first = chunks["chunk-000"]
        gpu = "cpu"
        if cuda:
            pinned = [(k.pin_memory(), v.pin_memory()) for k, v in first]
            rows["h2d_pinned"] = copy_seconds([t for kv in pinned for t in kv], dev, 10)
            whole = torch.cat([t.reshape(-1) for kv in first for t in kv]).pin_memory()
            rows["h2d_pinned_whole"] = copy_seconds([whole], dev, 10)
            rows["h2d_pageable"] = copy_seconds([t for kv in first for t in kv], dev, 10)
            rows["gpu_crc32"] = crc_seconds(first, dev, 10)
            rows["compute"], gpu = compute_seconds(args.model_dir, 10)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if shm:
            shutil.rmtree(shm, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    table = paths_table(rows, chunk_bytes, no_rate=("compute", "lookup_per_chunk"))
    ratios = {}
    ceiling = min(med.get("h2d_pinned", 0), med.get("h2d_pinned_whole", 0))   # the faster pinned copy of the chunk
    for k in ("arena_gpu", "arena_gpu_placed", "arena_gpu_at_once", "arena_gpu_x4", "arena", "arena_x4", "shm_file", "shm_file_x4", "stream"):
        if k in med and cuda:
            ratios[f"{k}_of_pinned_ceiling"] = ceiling / med[k]
            ratios[f"compute_over_{k}"] = med["compute"] / med[k]
    print(json.dumps(ratios, indent=1))
    write_result(args.json, device=gpu, chunk_bytes=chunk_bytes, chunks=args.chunks, rounds=args.rounds, paths=table,
                 ratios=ratios, samples_s=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
