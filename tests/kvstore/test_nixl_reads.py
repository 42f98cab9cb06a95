"""Store reads over NIXL on the CPU (issue #23): a store started with ``--nixl`` registers its arena with a NIXL agent,
and a caller on "another host" (a client that does not name the store's host) reads a chunk's layers from the store's
memory over UCX on loopback, checked as every read is; a damaged layer is refused and the read goes on by the stream;
a store without NIXL streams. The store runs as its own process and the reader in a child process: NIXL never loads in
the test process (services/handoff/nixl.py)."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from services.hostid import host_id
from services.kvstore.client import KVStoreClient
from services.rpc import kvstore_pb2 as pb
from services.tiers import Tier

from .helpers import flip_byte, make_layers

REPO = Path(__file__).resolve().parents[2]
SHAPE = {"n_layers": 4, "tokens": 96, "heads": 2, "dim": 32}


@pytest.fixture
def store(tmp_path):
    """start(nixl=True) -> the address of a store process with its DRAM tier as an arena in shared memory
    (``start.pid``: the last one's process id)."""
    procs, dirs = [], []
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else str(tmp_path)

    def start(nixl: bool = True) -> str:
        dram = os.path.join(base, f"tessera-test-nixl-{os.getpid()}-{os.urandom(3).hex()}")
        dirs.append(dram)
        cmd = [sys.executable, "-m", "services.cli", "kvstore", "serve", "--port", "0", "--dram-bytes", "32M",
               "--dram-dir", dram, "--dram-segment-bytes", "8M", "--rocksdb-dir", str(tmp_path / f"db{len(procs)}"),
               "--log-level", "WARNING"] + (["--nixl"] if nixl else [])
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        for _ in range(50):                 # NIXL logs a line or two of its own first
            line = proc.stdout.readline()
            if line.startswith("kvstore listening on") or not line:
                break
        assert line.startswith("kvstore listening on"), line
        start.pid = proc.pid
        return line.split()[3]

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(30)
    for path in dirs:               # a store killed by its test leaves its tier behind
        shutil.rmtree(path, ignore_errors=True)


def _reader(conn, address: str, chunk_id: str) -> None:
    """Read the chunk as a NIXL client on another host; send back (layers equal to the seeded ones, reads by path,
    fallbacks, why NIXL was not used) or the error's (type name, status code name)."""
    import torch

    client = KVStoreClient(address, timeout=30, nixl=True)
    try:
        got = list(client.get(chunk_id))
    except grpc.RpcError as exc:
        conn.send(("RpcError", exc.code().name, dict(client.reads), dict(client.fallbacks)))
        return
    want = make_layers(**SHAPE, seed=1)
    same = len(got) == len(want) and all(torch.equal(k, k0) and torch.equal(v, v0)
                                         for (_, k, v), (k0, v0) in zip(got, want))
    conn.send(("read", same, dict(client.reads), dict(client.fallbacks), client.nixl_unavailable))
    client.close()


def _read_in_child(address: str, chunk_id: str):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_reader, args=(child, address, chunk_id), daemon=True)
    proc.start()
    try:
        assert parent.poll(60), "the reader did not answer"
        return parent.recv()
    finally:
        proc.join(30)


def test_a_chunk_is_read_over_nixl_from_the_stores_memory(store):
    address = store()
    with KVStoreClient(address, timeout=30) as plain:
        plain.put("doc-n", make_layers(**SHAPE, seed=1))
    kind, same, reads, fallbacks, why = _read_in_child(address, "doc-n")
    assert kind == "read" and same and why == ""
    assert reads["nixl"] == 1 and reads["stream"] == 0 and not any(fallbacks.values())


def test_a_damaged_layer_read_over_nixl_is_refused_and_read_on_from_a_good_copy(store):
    address = store()
    with KVStoreClient(address, timeout=30) as plain:
        plain.put("doc-d", make_layers(**SHAPE, seed=1))       # write-through: RocksDB holds it too
        stream = plain._get(pb.GetRequest(chunk_id="doc-d", local_host=host_id()), timeout=30)
        [where] = [m.local for m in stream if hasattr(m, "HasField") and m.HasField("local")]
        flip_byte(where.path, where.offsets[2] + 5, 0x10)      # a byte of layer 2, in the store's memory
        kind, same, reads, fallbacks, _ = _read_in_child(address, "doc-d")
        # layers 0 and 1 handed on from the NIXL read; from layer 2 on the stream, where the store finds its DRAM copy
        # damaged, drops it and serves RocksDB's
        assert kind == "read" and same
        assert reads["nixl"] == 1 and reads["stream"] == 1 and fallbacks["damaged"] == 1
        assert plain.lookup(["doc-d"])[0].tiers == (Tier.ROCKSDB,)


def test_a_store_without_nixl_streams_the_bytes(store):
    address = store(nixl=False)
    with KVStoreClient(address, timeout=30) as plain:
        plain.put("doc-s", make_layers(**SHAPE, seed=1))
    kind, same, reads, fallbacks, why = _read_in_child(address, "doc-s")
    assert kind == "read" and same and reads["nixl"] == 0 and reads["stream"] == 1


def _reader_whose_store_dies(conn, address: str, chunk_id: str, store_pid: int) -> None:
    """As ``_reader``, the store process killed between its answer and the NIXL read."""
    import signal
    import time

    from services.handoff import nixl

    real = nixl.NixlEndpoint.read_descs

    def read_after_the_store_died(self, *args, **kwargs):
        os.kill(store_pid, signal.SIGKILL)
        time.sleep(0.5)
        return real(self, *args, **kwargs)

    nixl.NixlEndpoint.read_descs = read_after_the_store_died
    client = KVStoreClient(address, timeout=10, nixl=True)
    t0 = time.monotonic()
    try:
        list(client.get(chunk_id))
        conn.send(("read", time.monotonic() - t0, dict(client.fallbacks)))
    except grpc.RpcError as exc:
        conn.send((exc.code().name, time.monotonic() - t0, dict(client.fallbacks)))
    except Exception as exc:     # noqa: BLE001 - reported to the test
        conn.send((type(exc).__name__, time.monotonic() - t0, str(exc)))


def test_a_store_that_dies_before_the_nixl_read_fails_the_read_clearly(store):
    address = store()
    with KVStoreClient(address, timeout=30) as plain:
        plain.put("doc-k", make_layers(**SHAPE, seed=1))
    pid = store.pid
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_reader_whose_store_dies, args=(child, address, "doc-k", pid), daemon=True)
    proc.start()
    try:
        assert parent.poll(60), "the reader did not answer"
        what, seconds, fallbacks = parent.recv()
    finally:
        proc.join(30)
    # the NIXL read fails, the read goes on by the stream, the store is gone: the caller is told so, in bounded time
    assert what == "UNAVAILABLE" and seconds < 30 and fallbacks["moved"] == 1, (what, seconds, fallbacks)

