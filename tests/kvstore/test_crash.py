"""A store killed with SIGKILL during a load serves, after a restart on the same RocksDB
directory, every chunk it acknowledged, byte for byte (the `tessera kvstore serve` process)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest

from services.kvstore import KVStoreClient

from .helpers import assert_roundtrip, make_layers

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def start_serve(rocksdb_dir: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "kvstore", "serve", "--port", "0", "--dram-bytes", "8M",
         "--rocksdb-dir", str(rocksdb_dir), "--rocksdb-bytes", "1G", "--log-level", "WARNING"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=60)
        except queue.Empty:
            proc.kill()
            raise AssertionError("the store did not start within 60 s") from None
        if line.startswith("kvstore listening on "):
            return proc, line.split()[3]


def test_sigkill_during_load_loses_no_acknowledged_chunk(tmp_path):
    proc, address = start_serve(tmp_path / "db")
    acked: dict[str, list] = {}
    attempted: dict[str, list] = {}
    enough = threading.Event()
    lock = threading.Lock()

    def load(worker: int) -> None:
        with KVStoreClient(address, timeout=20) as c:
            for i in range(400):          # bounded; the kill ends it long before
                cid = f"w{worker}-{i:04d}"
                layers = make_layers(n_layers=4, tokens=64, heads=4, dim=64, seed=worker * 1000 + i)  # 256 KiB
                attempted[cid] = layers
                try:
                    c.put(cid, layers)
                except grpc.RpcError:
                    return                # the store died under us
                with lock:
                    acked[cid] = layers
                    if len(acked) >= 40:
                        enough.set()

    workers = [threading.Thread(target=load, args=(w,)) for w in range(2)]
    for t in workers:
        t.start()
    assert enough.wait(120), "the load did not reach 40 acknowledged puts"
    os.kill(proc.pid, signal.SIGKILL)     # mid-load: puts are in flight
    proc.wait(30)
    for t in workers:
        t.join(60)
    assert proc.returncode == -signal.SIGKILL

    proc, address = start_serve(tmp_path / "db")
    try:
        with KVStoreClient(address, timeout=30) as c:
            locations = c.lookup(list(attempted))
            assert all(loc.found for loc in locations if loc.chunk_id in acked)
            for cid, layers in acked.items():
                assert_roundtrip(c, cid, layers)
            # An unacknowledged put is either absent or whole: never a partial chunk.
            for loc in locations:
                if loc.found and loc.chunk_id not in acked:
                    assert_roundtrip(c, loc.chunk_id, attempted[loc.chunk_id])
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
