"""The DRAM tier in shared memory: workers on the store's host read a chunk's layers from its file (``LocalLayers``),
checked against the header's crc32; a caller from elsewhere, or one whose file went away, is streamed the bytes. Each
test runs on both layouts of the tier: a file per chunk, and the arena of segment files (``arena.Arena``), whose
extents a reader views without a copy."""

from __future__ import annotations

import os
import stat

import grpc
import pytest

from services.hostid import host_id
from services.kvstore.client import KVStoreClient
from services.rpc import kvstore_pb2 as pb

from .helpers import MiB, assert_roundtrip, flip_byte, make_layers, tiers_of


@pytest.fixture
def shm_dir(tmp_path):
    """A directory for the tier: under /dev/shm where this machine has one with room, else the test's own (the tier
    is files in a directory either way)."""
    from services.kvstore.store import shm_room

    usable = os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) and shm_room("/dev/shm") >= 1 << 30
    base = "/dev/shm" if usable else str(tmp_path)
    path = os.path.join(base, f"tessera-test-{os.getpid()}-{os.urandom(4).hex()}")
    yield path
    if os.path.isdir(path):
        for name in os.listdir(path):
            os.unlink(os.path.join(path, name))
        os.rmdir(path)


@pytest.fixture(params=["file", "arena"])
def shm_store(request, start_store, shm_dir):
    """start(**StoreConfig fields) -> (server, client) with the DRAM tier in ``shm_dir``, laid out as the test's
    parameter says; ``start.arena``: whether it is the arena."""
    arena = request.param == "arena"

    def start(**fields):
        fields.setdefault("dram_segment_bytes", 8 * MiB if arena else 0)
        return start_store(dram_dir=shm_dir, **fields)
    start.arena = arena
    return start


def files_of(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if not n.startswith("."))


def chunk_files(path: str) -> list[str]:
    """The tier's files of chunks of their own (not the arena's segments)."""
    return [n for n in files_of(path) if not n.startswith("seg-")]


def local_place(client: KVStoreClient, chunk_id: str) -> pb.LocalLayers:
    """Where the store tells a caller on its host to read ``chunk_id``'s layers."""
    stream = client._get(pb.GetRequest(chunk_id=chunk_id, local_host=host_id()), timeout=30)
    [local] = [m.local for m in stream if hasattr(m, "HasField") and m.HasField("local")]
    return local


def test_a_local_get_reads_the_file_and_a_remote_one_is_streamed(shm_store, shm_dir):
    srv, plain = shm_store()
    layers = make_layers(n_layers=5, tokens=70, heads=3, dim=24, seed=1)
    plain.put("doc-a", layers)
    assert tiers_of(plain, "doc-a") == ("dram",)
    [name] = files_of(shm_dir)
    assert name.startswith("seg-") == shm_store.arena
    assert stat.S_IMODE(os.stat(shm_dir).st_mode) == 0o700       # only the store's user reads the tier
    assert stat.S_IMODE(os.stat(os.path.join(shm_dir, name)).st_mode) == 0o600
    local = KVStoreClient(srv.address, timeout=30, local=True)
    try:
        assert_roundtrip(local, "doc-a", layers)
        assert_roundtrip(local, "doc-a", layers, (1, 4))
        assert local.local_reads == 2 and local.arena_reads == (2 if shm_store.arena else 0)
        _, k, _ = next(iter(local.get("doc-a")))
        if shm_store.arena:         # a view of the store's segment, read-only, no copy: whoever keeps it copies it
            assert local.in_arena(k) and not plain.in_arena(k)
        else:                       # the client's own memory: writable, the file untouched
            k.zero_()
            assert not local.in_arena(k)
        assert_roundtrip(local, "doc-a", layers)
        assert_roundtrip(plain, "doc-a", layers)      # a caller not on the store's host: frames
        assert plain.local_reads == 0
    finally:
        local.close()


def test_another_hosts_id_gets_the_bytes_not_the_file(start_store, shm_dir):
    srv, plain = start_store(dram_dir=shm_dir)
    plain.put("doc-b", make_layers(n_layers=2, seed=2))
    stub = plain._get(pb.GetRequest(chunk_id="doc-b", local_host="elsewhere/" + host_id()), timeout=30)
    kinds = [("frame" if not hasattr(m, "HasField") else m.WhichOneof("item")) for m in stub]
    assert kinds[0] == "header" and "local" not in kinds and len(kinds) == 3


def _flip_a_byte_in_the_middle(client: KVStoreClient, chunk_id: str) -> None:
    local = local_place(client, chunk_id)
    flip_byte(local.path, local.offsets[len(local.offsets) // 2] + 100)     # a byte of the middle layer's K||V


def test_a_damaged_file_is_never_used_and_its_only_copy_is_dropped(shm_store, shm_dir):
    srv, plain = shm_store()
    plain.put("doc-c", make_layers(n_layers=3, tokens=64, seed=3))
    _flip_a_byte_in_the_middle(plain, "doc-c")
    local = KVStoreClient(srv.address, timeout=30, local=True)
    try:
        got = []
        with pytest.raises(grpc.RpcError) as err:       # the rest re-read by the stream: the store finds it damaged
            for i, _, _ in local.get("doc-c"):
                got.append(i)
        assert err.value.code() == grpc.StatusCode.DATA_LOSS and got == [0] and local.local_damaged == 1
        assert chunk_files(shm_dir) == [] and not plain.lookup(["doc-c"])[0].found
    finally:
        local.close()


def test_a_damaged_file_is_read_on_from_a_good_copy_below(shm_store):
    """The rest of the read from RocksDB; the next read stages the chunk through the arena (read, checked, promoted)
    and is answered with its place, where the tier has one."""
    srv, plain = shm_store(rocksdb_dir="tmp")      # write-through: RocksDB holds it too
    layers = make_layers(n_layers=3, tokens=64, seed=11)
    plain.put("doc-k", layers)
    _flip_a_byte_in_the_middle(plain, "doc-k")
    local = KVStoreClient(srv.address, timeout=30, local=True)
    try:
        assert_roundtrip(local, "doc-k", layers)        # layer 0 from the file, 1 and 2 from RocksDB
        assert local.local_reads == 1 and local.local_damaged == 1
        assert tiers_of(plain, "doc-k") == ("rocksdb",)            # the damaged copy dropped
        # from RocksDB whole and promoted to DRAM again: through the arena first, then read here (staged), or
        # streamed (a file per chunk)
        assert_roundtrip(local, "doc-k", layers)
        staged = 1 if shm_store.arena else 0
        assert tiers_of(plain, "doc-k") == ("dram", "rocksdb") and local.local_reads == 1 + staged
        assert local.reads["stream"] == 2 - staged     # the damaged read's rest, and the file layout's second read
        assert_roundtrip(local, "doc-k", layers)        # from DRAM
        assert local.local_reads == 2 + staged and local.local_damaged == 1
    finally:
        local.close()


def test_a_file_gone_before_the_read_is_streamed_instead(shm_store, shm_dir, monkeypatch):
    srv, plain = shm_store()
    layers = make_layers(n_layers=3, seed=4)
    plain.put("doc-d", layers)
    local = KVStoreClient(srv.address, timeout=30, local=True)
    real_open = os.open
    gone = []

    def open_once_missing(path, *args, **kwargs):     # the chunk evicted between the reply and the open
        if path.startswith(shm_dir) and not gone:
            gone.append(path)
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_once_missing)
    try:
        assert_roundtrip(local, "doc-d", layers)
        assert gone and local.local_reads == 0
    finally:
        local.close()


def test_eviction_replacement_and_delete_remove_files_and_a_restart_starts_empty(start_store, shm_dir):
    srv, plain = start_store(dram_dir=shm_dir, dram_bytes=1 * MiB, dram_segment_bytes=0)
    small = make_layers(n_layers=2, tokens=64, heads=2, dim=32, seed=5)       # 32 KiB
    plain.put("doc-e", small)
    plain.put("doc-f", make_layers(n_layers=2, tokens=64, heads=2, dim=32, seed=6))
    assert len(files_of(shm_dir)) == 2
    assert plain.delete("doc-e")
    assert len(files_of(shm_dir)) == 1
    big = make_layers(n_layers=4, tokens=1024, heads=2, dim=32, seed=7)      # 1 MiB: evicts doc-f
    plain.put("doc-g", big)
    assert len(files_of(shm_dir)) == 1 and not plain.lookup(["doc-f"])[0].found
    srv.stop()
    srv2, plain2 = start_store(dram_dir=shm_dir)
    assert files_of(shm_dir) == [] and not plain2.lookup(["doc-g"])[0].found


def test_write_behind_copies_a_shared_memory_chunk_down(shm_store, shm_dir):
    srv, plain = shm_store(rocksdb_dir="tmp", write_mode="behind")
    layers = make_layers(n_layers=3, seed=8)
    plain.put("doc-h", layers)
    for _ in range(200):
        if "rocksdb" in tiers_of(plain, "doc-h"):
            break
        import time

        time.sleep(0.05)
    assert tiers_of(plain, "doc-h") == ("dram", "rocksdb")
    assert plain.delete("doc-h") and chunk_files(shm_dir) == []


def test_a_bad_dram_dir_is_refused(tmp_path):
    from services.kvstore.config import StoreConfig

    with pytest.raises(FileNotFoundError, match="parent directory of dram_dir"):
        StoreConfig(dram_dir=str(tmp_path / "no" / "such"))


def test_a_shared_memory_dir_without_room_for_the_budget_keeps_the_tier_in_process(start_store, shm_dir, monkeypatch):
    from services.kvstore import store as store_module

    monkeypatch.setattr(store_module, "shm_room", lambda _path: 1024)
    srv, plain = start_store(dram_dir=shm_dir)
    plain.put("doc-i", make_layers(n_layers=2, seed=9))
    assert tiers_of(plain, "doc-i") == ("dram",) and not os.path.exists(shm_dir)


def test_a_cluster_plan_puts_each_shards_dram_tier_in_shared_memory_and_removes_it(tmp_path):
    from services.cluster.config import ClusterConfig
    from services.launch.plan import SHM, Plan

    cfg = ClusterConfig(model_dir=str(tmp_path), stores=2, store_dir=str(tmp_path / "db"))
    plan = Plan.make(cfg)
    try:
        specs = plan.store_specs()
        if not (os.path.isdir(SHM) and os.access(SHM, os.W_OK)):
            assert plan.shm_scratch is None and all(s.store.dram_dir is None for s in specs)
            return
        assert plan.shm_scratch.startswith(SHM + "/tessera-dram-")
        assert [s.store.dram_dir for s in specs] == [os.path.join(plan.shm_scratch, n) for n in plan.names["store"]]
    finally:
        plan.remove_scratch()
    assert not os.path.exists(plan.shm_scratch)
    off = Plan.make(ClusterConfig(model_dir=str(tmp_path), stores=1, store_dir=str(tmp_path / "db"), store_shm=False))
    assert off.shm_scratch is None and off.store_specs()[0].store.dram_dir is None and not specs[0].store.nixl


def test_a_cluster_on_nixl_runs_its_stores_nixl_agents(tmp_path):
    from services.cluster.config import ClusterConfig, PrefillSettings
    from services.launch.plan import Plan

    plan = Plan.make(ClusterConfig(model_dir=str(tmp_path), stores=1, store_dir=str(tmp_path / "db"),
                                   prefill_settings=PrefillSettings(handoff_transport="nixl")))
    try:
        [spec] = plan.store_specs()
        assert spec.store.nixl == (plan.shm_scratch is not None)       # NIXL reads need the arena in shared memory
    finally:
        plan.remove_scratch()


def open_in(path: str) -> int:
    """This process's descriptors open on files under ``path`` (others come and go with other threads' work)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(os.path.realpath(path))
        except OSError:                 # closed since it was listed
            pass
    return count


def test_a_reader_that_stops_early_leaves_no_descriptor_open(shm_store, shm_dir):
    srv, plain = shm_store()
    plain.put("doc-j", make_layers(n_layers=12, tokens=64, seed=10))
    local = KVStoreClient(srv.address, timeout=30, local=True)
    try:
        for _ in local.get("doc-j"):    # the arena's segment stays mapped (one descriptor) after the first read
            pass
        before = open_in(shm_dir)
        for _ in range(3):
            stream = local.get("doc-j")
            next(stream)
            stream.close()              # the reads ahead are waited for, then the file is closed
        assert local.local_reads == 4 and open_in(shm_dir) <= before
    finally:
        local.close()


def test_a_directory_holding_other_files_is_refused_and_left_as_it_is(shm_dir):
    import asyncio

    from services.kvstore.config import StoreConfig
    from services.kvstore.store import TieredStore

    os.makedirs(shm_dir)
    with open(os.path.join(shm_dir, "someone-elses"), "w") as f:
        f.write("keep me")
    store = TieredStore(StoreConfig(dram_dir=shm_dir))
    with pytest.raises(ValueError, match="not a Tessera DRAM tier's"):
        asyncio.run(store.start())
    assert os.listdir(shm_dir) == ["someone-elses"]


def test_a_lookup_names_the_arena_directory_to_a_caller_on_its_host_only(shm_store, shm_dir):
    """A worker on the store's host learns where the arena's segments are from its first lookup, and maps and
    registers them as they appear (``segments.SharedSegments.watch``); a caller from elsewhere learns nothing."""
    srv, client = shm_store()
    client.put("doc-w", make_layers(n_layers=2, seed=3))
    here = client._stub.Lookup(pb.LookupRequest(chunk_ids=["doc-w"], local_host=host_id()), timeout=30)
    away = client._stub.Lookup(pb.LookupRequest(chunk_ids=["doc-w"], local_host="elsewhere/" + host_id()), timeout=30)
    unnamed = client._stub.Lookup(pb.LookupRequest(chunk_ids=["doc-w"]), timeout=30)
    assert away.arena_directory == "" and unnamed.arena_directory == ""
    if shm_store.arena:
        assert here.arena_directory == shm_dir and any(n.startswith("seg-") for n in os.listdir(shm_dir))
    else:
        assert here.arena_directory == ""              # a file per chunk: no segments to register
    watched = []
    local = KVStoreClient(srv.address, timeout=30, local=True)
    try:
        local.segments.watch = watched.append          # what a GPU worker's client then does with it
        assert local.lookup(["doc-w"])[0].found
        assert watched == ([shm_dir] if shm_store.arena else [])
    finally:
        local.close()
