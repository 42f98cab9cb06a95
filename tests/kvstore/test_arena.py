"""The shared-memory tier's arena (``arena.Arena``): extents of segment files, reused only after a grace; readers on the
store's host view them without a copy and check the extent's generation before they hand on each layer."""

from __future__ import annotations

import contextlib
import os

import grpc
import torch
import pytest

from services.kvstore import arena as arena_module
from services.kvstore.arena import HEADER, PAGE, Arena
from services.kvstore.client import ChunkCorruptError, KVStoreClient

from .helpers import MiB, assert_roundtrip, assert_same_layers, flip_byte, make_layers, tiers_of
from .test_shm_tier import local_place, shm_dir  # noqa: F401 - the fixture


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_extents_are_first_fit_coalesce_and_rest_for_the_grace(tmp_path):
    clock = Clock()
    arena = Arena(str(tmp_path), budget=64 * PAGE, segment_bytes=32 * PAGE, grace_s=5.0, clock=clock)
    try:
        a = arena.allocate(3 * PAGE)            # header + 3 pages
        b = arena.allocate(PAGE + 1)            # header + 2 pages
        assert (a.segment, a.offset, a.length) == (0, 0, 4 * PAGE)
        assert (b.segment, b.offset, b.length) == (0, 4 * PAGE, 3 * PAGE)
        assert b.generation > a.generation > 0 and a.data == HEADER
        arena.write(a, [b"x" * 100])
        assert arena.generation(a) == a.generation and arena.generation(b) == 0    # b's header not written yet
        arena.release(a)
        assert arena.generation(a) == 0                                 # readers see it gone at once
        c = arena.allocate(3 * PAGE)            # a's room still rests: after b
        assert c.offset == 7 * PAGE
        clock.now = 5.0
        d = arena.allocate(3 * PAGE)            # a's room again, first fit
        assert d.offset == 0 and d.generation not in (a.generation, c.generation)
        arena.release(b)
        arena.release(c)
        arena.release(d)
        clock.now = 10.0
        whole = arena.allocate(32 * PAGE - HEADER)  # all of segment 0, coalesced
        assert (whole.segment, whole.offset) == (0, 0)
        second = arena.allocate(32 * PAGE - HEADER)  # the budget's second segment
        assert second.segment == 1
        assert arena.allocate(PAGE) is None          # the budget is made; nothing free
        assert sorted(os.listdir(tmp_path)) == ["seg-0000", "seg-0001"]
        assert all(os.stat(tmp_path / n).st_mode & 0o777 == 0o600 for n in os.listdir(tmp_path))
    finally:
        arena.close()
    assert os.listdir(tmp_path) == []


def test_a_write_past_its_extent_is_refused(tmp_path):
    arena = Arena(str(tmp_path), budget=16 * PAGE, segment_bytes=16 * PAGE)
    try:
        extent = arena.allocate(PAGE)
        with pytest.raises(ValueError, match="overruns"):
            arena.write(extent, [bytes(PAGE), b"!"])
        assert arena.generation(extent) == 0
    finally:
        arena.close()


def test_a_too_small_segment_is_refused(tmp_path):
    from services.kvstore.config import StoreConfig

    with pytest.raises(ValueError, match="under two pages"):
        Arena(str(tmp_path), budget=MiB, segment_bytes=PAGE)
    with pytest.raises(ValueError, match="dram_segment_bytes"):
        StoreConfig(dram_dir=str(tmp_path / "d"), dram_segment_bytes=100)


def arena_store(start_store, shm_dir, **fields):  # noqa: F811 - the fixture's name
    fields.setdefault("dram_segment_bytes", 4 * MiB)
    return start_store(dram_dir=shm_dir, **fields)


def test_a_chunk_without_room_in_the_arena_gets_a_file_of_its_own(start_store, shm_dir):  # noqa: F811
    srv, plain = arena_store(start_store, shm_dir, dram_bytes=8 * MiB, dram_segment_bytes=1 * MiB)
    big = make_layers(n_layers=4, tokens=1024, heads=2, dim=64, seed=1)          # 2 MiB: over a segment
    small = make_layers(n_layers=2, tokens=64, heads=2, dim=32, seed=2)
    plain.put("doc-big", big)
    plain.put("doc-small", small)
    names = sorted(os.listdir(shm_dir))
    assert "seg-0000" in names and any(n.startswith("doc-big.") for n in names)
    assert local_place(plain, "doc-big").generation == 0 and local_place(plain, "doc-small").generation > 0
    with KVStoreClient(srv.address, timeout=30, local=True) as local:
        assert_roundtrip(local, "doc-big", big)
        assert_roundtrip(local, "doc-small", small)
        assert local.local_reads == 2 and local.arena_reads == 1


def test_a_read_whose_extent_moves_on_goes_on_by_the_stream(start_store, shm_dir, monkeypatch):  # noqa: F811
    """The chunk deleted and its extent reused (no grace here) while a reader is between layers: the reader hands on
    nothing of the new content; it goes on by the stream, where the store says the chunk is gone."""
    monkeypatch.setattr(arena_module, "REUSE_GRACE_S", 0.0)
    srv, plain = arena_store(start_store, shm_dir)
    layers = make_layers(n_layers=6, tokens=64, heads=2, dim=32, seed=3)
    plain.put("doc-a", layers)
    with KVStoreClient(srv.address, timeout=30, local=True) as local:
        stream = local.get("doc-a")
        first = next(stream)
        assert first[0] == 0 and local.in_arena(first[1])
        where = local_place(plain, "doc-a")
        assert plain.delete("doc-a")
        plain.put("doc-b", make_layers(n_layers=6, tokens=64, heads=2, dim=32, seed=4))     # the same room
        assert local_place(plain, "doc-b").header == where.header
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and local.local_damaged == 0


def test_a_restarted_store_is_mapped_again(start_store, shm_dir):  # noqa: F811
    srv, plain = arena_store(start_store, shm_dir)
    layers = make_layers(n_layers=3, seed=5)
    plain.put("doc-c", layers)
    local = KVStoreClient(srv.address, timeout=30, local=True)
    local2 = None
    try:
        assert_roundtrip(local, "doc-c", layers)
        before = dict(local.segments._maps)
        srv.stop()
        srv2, plain2 = arena_store(start_store, shm_dir)        # the same directory: new segment files
        other = make_layers(n_layers=3, seed=6)
        plain2.put("doc-c", other)
        local2 = KVStoreClient(srv2.address, timeout=30, local=True)
        local2.segments = local.segments                          # the same process's maps
        assert_roundtrip(local2, "doc-c", other)
        assert local2.arena_reads == 1
        [(path, old)] = before.items()
        assert local.segments._maps[path] is not old              # the new file mapped, the old map dropped
    finally:
        if local2 is not None:
            local2.close()
        local.close()


def test_the_host_tier_does_not_keep_views_of_the_arena(start_store, shm_dir):  # noqa: F811
    from services.cluster.kvio import StoreAccess

    srv, plain = arena_store(start_store, shm_dir)
    layers = make_layers(n_layers=3, seed=7)
    plain.put("doc-d", layers)
    access = StoreAccess([srv.address], host_bytes=64 * MiB)
    try:
        present = access.lookup(["doc-d"])
        got = list(access.fetcher(present)("doc-d"))
        assert len(got) == 3 and access.in_arena(got[0].k)
        access._keeper.submit(lambda: None).result()              # a keep would have been queued before this
        assert "doc-d" not in access.host
        assert tiers_of(plain, "doc-d") == ("dram",)
    finally:
        access.close()


@pytest.fixture
def on_device(monkeypatch):
    """Arena reads given a device take the copy-and-check-there path on the CPU too (the checksum's twin)."""
    monkeypatch.setattr(KVStoreClient, "check_on", ("cuda", "cpu"))
    return torch.device("cpu")


def test_a_read_onto_a_device_is_checked_there(start_store, shm_dir, on_device, monkeypatch):  # noqa: F811
    from services.kvstore import client as client_module

    monkeypatch.setattr(client_module, "ARENA_GROUP", 3)        # several groups, the last one short
    srv, plain = arena_store(start_store, shm_dir)
    layers = make_layers(n_layers=7, tokens=70, heads=3, dim=24, seed=8)
    plain.put("doc-e", layers)
    with KVStoreClient(srv.address, timeout=30, local=True) as local:
        got = list(local.get("doc-e", device=on_device))
        assert [i for i, _, _ in got] == list(range(7)) and local.arena_reads == 1
        assert not any(local.in_arena(k) or local.in_arena(v) for _, k, v in got)     # copies, not views
        assert_same_layers(got, layers)
        assert [i for i, _, _ in local.get("doc-e", layers=(2, 6), device=on_device)] == [2, 3, 4, 5]


@pytest.mark.parametrize("group", [1, 2, 3, 8])
def test_a_device_reads_groups_keep_layer_order_and_end_small(group, monkeypatch):
    """Every layer once, in order; after the full groups the rest is halved down to groups of at most two (little is
    left to check once the last copy lands)."""
    from services.kvstore import client as client_module

    monkeypatch.setattr(client_module, "ARENA_GROUP", group)
    for n in range(1, 40):
        groups = client_module._groups(list(range(n)))
        assert [i for g in groups for i in g] == list(range(n))
        assert all(1 <= len(g) <= max(group, 2) for g in groups)
        assert len(groups[-1]) <= 2
    assert [len(g) for g in client_module._groups(list(range(32)))] == {1: [1] * 32, 2: [2] * 16, 3: [3] * 10 + [2],
                                                                         8: [8, 8, 8, 4, 2, 2]}[group]


def test_a_damaged_layer_landed_on_a_device_is_never_handed_on(start_store, shm_dir, on_device):  # noqa: F811
    srv, plain = arena_store(start_store, shm_dir, rocksdb_dir="tmp")
    layers = make_layers(n_layers=5, tokens=64, seed=9)
    plain.put("doc-f", layers)
    where = local_place(plain, "doc-f")
    flip_byte(where.path, where.offsets[3] + 10, 1)         # a byte of layer 3
    with KVStoreClient(srv.address, timeout=30, local=True) as local:
        got = list(local.get("doc-f", device=on_device))   # layers 3 and 4 by the stream, from RocksDB's copy
        assert_same_layers(got, layers)
        assert len(got) == 5 and local.local_damaged == 1 and tiers_of(plain, "doc-f") == ("rocksdb",)


def test_the_device_checks_warm_up_and_check_themselves(monkeypatch):
    """warm_device_checks runs the kernel once and compares it with the host's CRC (the kernel's twin here)."""
    from services.kvstore import client as client_module
    import kernels.checksum as checksum_module

    real = checksum_module.crc32_spans
    calls = []

    def twin(data, starts, lengths, backend="torch"):
        calls.append(backend)
        return real(data, starts, lengths, backend="torch")

    monkeypatch.setattr(checksum_module, "crc32_spans", twin)
    client_module.warm_device_checks("cpu")
    assert calls == ["triton"]
    monkeypatch.setattr(checksum_module, "crc32_spans", lambda *a, **k: torch.tensor([1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="checksum kernel is wrong"):
        client_module.warm_device_checks("cpu")


def test_workers_count_their_reads_by_path_and_fallback(start_store, shm_dir, on_device):  # noqa: F811
    """What a worker's /metrics shows of its store reads: the arena onto the device, its views, the stream, and the
    reads that went on by the stream."""
    from prometheus_client import CollectorRegistry, generate_latest

    from services.cluster.kvio import StoreAccess, StoreReadMetrics

    srv, plain = arena_store(start_store, shm_dir, rocksdb_dir="tmp")
    plain.put("doc-g", make_layers(n_layers=3, seed=10))
    access = StoreAccess([srv.address])
    registry = CollectorRegistry()
    registry.register(StoreReadMetrics(access, "tessera_prefill"))
    try:
        present = access.lookup(["doc-g"])
        assert len(list(access.fetcher(present, on_device)("doc-g"))) == 3
        assert len(list(access.fetcher(present)("doc-g"))) == 3
        where = local_place(plain, "doc-g")
        flip_byte(where.path, where.offsets[1], 1)      # layer 1 damaged: the read goes on by the stream
        assert len(list(access.fetcher(present)("doc-g"))) == 3
        text = generate_latest(registry).decode()
        for line in ('tessera_prefill_store_reads_total{path="arena-device"} 1.0',
                     'tessera_prefill_store_reads_total{path="arena"} 2.0',
                     'tessera_prefill_store_reads_total{path="stream"} 1.0',
                     'tessera_prefill_store_reads_total{path="file"} 0.0',
                     'tessera_prefill_store_read_fallbacks_total{why="damaged"} 1.0',
                     'tessera_prefill_store_read_fallbacks_total{why="moved"} 0.0'):
            assert line in text, line
    finally:
        access.close()


def test_a_chunk_only_a_lower_tier_holds_is_staged_through_the_arena_for_a_reader_here(start_store, shm_dir):  # noqa: F811
    """The DRAM tier evicted it, RocksDB holds it: a reader on the store's host gets it through the arena (read,
    checked, promoted, then its place); a read of some of its layers is streamed as before."""
    srv, plain = arena_store(start_store, shm_dir, rocksdb_dir="tmp", dram_bytes=1 * MiB)
    a = make_layers(n_layers=4, tokens=512, heads=2, dim=32, seed=11)            # 512 KiB each
    b = make_layers(n_layers=4, tokens=512, heads=2, dim=32, seed=12)
    c = make_layers(n_layers=4, tokens=512, heads=2, dim=32, seed=13)
    for cid, layers in (("doc-a", a), ("doc-b", b), ("doc-c", c)):
        plain.put(cid, layers)
    assert tiers_of(plain, "doc-a") == ("rocksdb",)
    with KVStoreClient(srv.address, timeout=30, local=True) as local:
        assert_roundtrip(local, "doc-a", a)
        # read here, from the arena or (its room freed by the evictions still resting) a file of the tier
        assert local.local_reads == 1 and local.reads["stream"] == 0
        assert tiers_of(plain, "doc-a") == ("dram", "rocksdb")
        evicted = next(cid for cid in ("doc-b", "doc-c") if tiers_of(plain, cid) == ("rocksdb",))
        assert_roundtrip(local, evicted, b if evicted == "doc-b" else c, (1, 3))     # some layers: streamed
        assert local.reads["stream"] == 1 and tiers_of(plain, evicted) == ("rocksdb",)


def _counting_gets(client: KVStoreClient) -> list:
    """Count the client's Get calls (the bulk RPC, wrapped)."""
    calls, real = [], client._get

    def counted(request, **kwargs):
        calls.append(request.chunk_id)
        return real(request, **kwargs)

    client._get = counted
    return calls


def test_a_lookup_here_gives_the_arena_place_and_a_read_from_it_needs_no_get(start_store, shm_dir):  # noqa: F811
    srv, plain = arena_store(start_store, shm_dir)
    layers = make_layers(n_layers=5, tokens=70, heads=3, dim=24, seed=14)
    plain.put("doc-p", layers)
    with KVStoreClient(srv.address, timeout=30, local=True) as local:
        assert plain.lookup(["doc-p"])[0].place is None              # not on the store's host: no place
        [loc] = local.lookup(["doc-p"])
        assert loc.found and loc.place is not None and loc.place.layers.generation
        assert local.lookup(["doc-none"])[0].place is None
        calls = _counting_gets(local)
        got = list(local.get("doc-p", place=loc.place))
        assert calls == [] and local.reads["arena"] == 1
        assert_same_layers(got, layers)


@contextlib.contextmanager
def _stale_place(start_store, shm_dir, monkeypatch, chunk: str, other: str, seed: int):  # noqa: F811
    """(a local client, ``chunk``'s looked-up location) after ``chunk`` was deleted and ``other`` put in its room."""
    monkeypatch.setattr(arena_module, "REUSE_GRACE_S", 0.0)
    srv, plain = arena_store(start_store, shm_dir)
    plain.put(chunk, make_layers(n_layers=3, seed=seed))
    with KVStoreClient(srv.address, timeout=30, local=True) as local:
        [loc] = local.lookup([chunk])
        assert plain.delete(chunk)
        plain.put(other, make_layers(n_layers=3, seed=seed + 1))       # the same room
        yield local, loc


def test_a_stale_place_is_read_on_by_a_get(start_store, shm_dir, monkeypatch):  # noqa: F811
    """The chunk deleted and its room reused between the lookup and the read: nothing of the new content is handed
    on; the read goes on by a Get, which finds the chunk gone."""
    with _stale_place(start_store, shm_dir, monkeypatch, "doc-q", "doc-r", seed=15) as (local, loc):
        calls = _counting_gets(local)
        with pytest.raises(grpc.RpcError) as err:
            list(local.get("doc-q", place=loc.place))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and calls == ["doc-q"]
        assert local.fallbacks["moved"] == 1 and local.local_damaged == 0


def test_a_workers_fetch_after_its_lookup_reads_the_arena_without_a_get(start_store, shm_dir):  # noqa: F811
    from services.cluster.kvio import StoreAccess

    srv, plain = arena_store(start_store, shm_dir)
    layers = make_layers(n_layers=3, seed=17)
    plain.put("doc-s", layers)
    access = StoreAccess([srv.address])
    try:
        [client] = access._client.clients()
        calls = _counting_gets(client)
        present = access.lookup(["doc-s"])
        assert len(list(access.fetcher(present)("doc-s"))) == 3 and calls == []
        assert len(list(access.fetcher(present)("doc-s"))) == 3 and calls == ["doc-s"]    # a place serves one read
    finally:
        access.close()


def test_a_device_read_hands_every_layer_over_at_once_and_verifies_before_use(start_store, shm_dir, on_device,  # noqa: F811
                                                                           monkeypatch):
    """``device_read``: all layers queued and handed over at once (``local``), checked by ``verify``; no Get."""
    from services.kvstore import client as client_module

    monkeypatch.setattr(client_module, "ARENA_GROUP", 2)
    srv, plain = arena_store(start_store, shm_dir)
    layers = make_layers(n_layers=5, tokens=40, heads=2, dim=16, seed=21)
    plain.put("doc-t", layers)
    with KVStoreClient(srv.address, timeout=30, local=True) as local:
        calls = _counting_gets(local)
        [loc] = local.lookup(["doc-t"])
        read = local.device_read("doc-t", loc.place, on_device)
        assert read is not None and read.local
        with pytest.raises(RuntimeError, match="before the read was issued"):
            read.verify()
        got = list(read)
        read.verify()
        assert len(got) == 5 and calls == [] and local.reads["arena-device"] == 1
        assert_same_layers(got, layers)
        assert not any(local.in_arena(k) for _, k, _ in got)
        with pytest.raises(RuntimeError, match="iterated once"):
            list(read)
        assert local.device_read("doc-t", None, on_device) is None                 # no place: by a Get
        assert local.device_read("doc-t", loc.place, torch.device("meta")) is None  # checks do not run there


def test_a_device_read_of_damaged_bytes_fails_its_verify_and_the_next_read_goes_by_a_get(start_store, shm_dir,  # noqa: F811
                                                                                       on_device):
    srv, plain = arena_store(start_store, shm_dir, rocksdb_dir="tmp")
    layers = make_layers(n_layers=4, tokens=64, seed=22)
    plain.put("doc-u", layers)
    where = local_place(plain, "doc-u")
    flip_byte(where.path, where.offsets[2] + 5, 8)              # a byte of layer 2
    with KVStoreClient(srv.address, timeout=30, local=True) as local:
        [loc] = local.lookup(["doc-u"])
        read = local.device_read("doc-u", loc.place, on_device)
        list(read)
        with pytest.raises(ChunkCorruptError, match="layer 2: checksum mismatch"):
            read.verify()
        assert local.fallbacks["damaged"] == 1 and local.local_damaged == 1
        [loc] = local.lookup(["doc-u"])
        assert local.device_read("doc-u", loc.place, on_device) is None      # refused once: this read by a Get
        got = list(local.get("doc-u", device=on_device))       # the Get's read finds the damage: the store drops it
        assert len(got) == 4
        assert_same_layers(got, layers)
        assert tiers_of(plain, "doc-u") == ("rocksdb",)


def test_a_device_read_whose_extent_moved_on_fails_its_verify(start_store, shm_dir, on_device,  # noqa: F811
                                                               monkeypatch):
    with _stale_place(start_store, shm_dir, monkeypatch, "doc-v", "doc-w", seed=23) as (local, loc):
        read = local.device_read("doc-v", loc.place, on_device)
        list(read)
        with pytest.raises(ChunkCorruptError, match="moved on"):
            read.verify()
        assert local.fallbacks["moved"] == 1 and local.local_damaged == 0


def test_a_workers_fetch_onto_a_device_is_one_read_of_every_layer_at_once(start_store, shm_dir,  # noqa: F811
                                                                                       on_device):
    """StoreAccess's fetch with a device and a looked-up place gives the engine a local, checked-later read."""
    from services.cluster.kvio import DeviceLayers, StoreAccess

    srv, plain = arena_store(start_store, shm_dir)
    plain.put("doc-x", make_layers(n_layers=3, seed=25))
    access = StoreAccess([srv.address])
    try:
        [client] = access._client.clients()
        client.local = True
        present = access.lookup(["doc-x"])
        layers = access.fetcher(present, on_device)("doc-x")
        assert isinstance(layers, DeviceLayers) and layers.local
        assert [item.layer for item in layers] == [0, 1, 2]
        layers.verify()
        assert client.reads["arena-device"] == 1
    finally:
        access.close()


def test_the_store_reports_its_arenas_room_and_the_chunks_it_had_none_for(start_store, shm_dir):  # noqa: F811
    from prometheus_client import generate_latest

    srv, plain = arena_store(start_store, shm_dir, dram_bytes=8 * MiB, dram_segment_bytes=1 * MiB)
    plain.put("doc-big", make_layers(n_layers=4, tokens=1024, heads=2, dim=64, seed=18))   # 2 MiB: over a segment
    plain.put("doc-small", make_layers(n_layers=2, tokens=64, heads=2, dim=32, seed=19))
    text = generate_latest(srv.server.metrics.registry).decode()
    assert "tessera_kvstore_arena_unplaced_total 1.0" in text
    free = float(next(line.split()[1] for line in text.splitlines()
                      if line.startswith("tessera_kvstore_arena_free_bytes ")))
    assert 0 < free < 9 * MiB + MiB // 8


def test_a_caller_naming_another_host_gets_no_place_and_bad_segment_sizes_are_refused(start_store, shm_dir, tmp_path):  # noqa: F811
    """A Lookup or Get naming a host that is not the store's gets no place in its memory (the bytes by the stream);
    a segment size under two pages is refused by name, at the command line too, and nothing is started."""
    import subprocess
    import sys

    from services.hostid import host_id
    from services.rpc import kvstore_pb2 as pb

    srv, plain = arena_store(start_store, shm_dir)
    plain.put("doc-t", make_layers(n_layers=2, seed=20))
    resp = plain._stub.Lookup(pb.LookupRequest(chunk_ids=["doc-t"], local_host="elsewhere/" + host_id()), timeout=30)
    assert resp.chunks[0].found and not resp.chunks[0].HasField("local")
    stream = plain._get(pb.GetRequest(chunk_id="doc-t", local_host="elsewhere/" + host_id(), nixl=True), timeout=30)
    kinds = [("frame" if not hasattr(m, "HasField") else m.WhichOneof("item")) for m in stream]
    assert kinds[0] == "header" and "local" not in kinds and "nixl" not in kinds
    out = subprocess.run([sys.executable, "-m", "services.cli", "kvstore", "serve", "--port", "0", "--dram-bytes", "8M",
                          "--dram-dir", str(tmp_path / "d"), "--dram-segment-bytes", "100",
                          "--rocksdb-dir", str(tmp_path / "db")], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "dram_segment_bytes" in out.stderr and not (tmp_path / "d").exists()


def test_a_fetch_given_an_unusable_place_reads_the_chunk_by_a_get(start_store, shm_dir, on_device):  # noqa: F811
    """A place naming another chunk is refused by the read onto the device, and the fetch goes by a Get: the engine
    gets the chunk's own layers, never the other chunk's."""
    from services.cluster.kvio import StoreAccess

    srv, plain = arena_store(start_store, shm_dir)
    mine, other = make_layers(n_layers=3, seed=26), make_layers(n_layers=3, seed=27)
    plain.put("doc-y", mine)
    plain.put("doc-z", other)
    access = StoreAccess([srv.address])
    try:
        [client] = access._client.clients()
        present = access.lookup(["doc-y", "doc-z"])
        access._places["doc-y"] = access._places["doc-z"]          # the wrong chunk's place
        calls = _counting_gets(client)
        got = list(access.fetcher(present, on_device)("doc-y"))
        assert calls == ["doc-y"] and len(got) == 3
        assert_same_layers(got, mine)
    finally:
        access.close()


def test_a_prefill_reading_chunks_onto_its_device_matches_and_recomputes_damaged_ones(start_store, shm_dir,  # noqa: F811
                                                                                     on_device, tiny_model):
    """End to end: an engine's pass over chunks read from the arena at once (``DeviceLayers``) gives the logits of
    the same pass over chunks computed in place; a chunk whose bytes in the arena are damaged fails its check and
    is recomputed before any layer is used: the logits do not change."""
    from services.cluster.kvio import StoreAccess
    from services.engine import Engine

    from tests.helpers import docs

    writer = Engine.load(tiny_model, kv_cache_bytes=64 << 20)
    chunks, suffix = docs(2, 40, seed=31), [5, 6, 7]
    want = writer.prefill(chunks, suffix).logits
    srv, plain = arena_store(start_store, shm_dir)
    ids = [writer.chunk_id(c) for c in chunks]
    for cid in ids:
        plain.put(cid, writer.export_chunk(cid), model_fingerprint=writer.fingerprint)
    for damage in (False, True):
        if damage:
            where = local_place(plain, ids[1])
            flip_byte(where.path, where.offsets[0] + 3, 2)
        eng = Engine.load(tiny_model, kv_cache_bytes=64 << 20)
        access = StoreAccess([srv.address])
        try:
            [client] = access._client.clients()
            client.local = True
            fetch = access.fetcher(access.lookup(ids), on_device)
            logits, seq, stats = eng._prefill(chunks, suffix, "tessera", 0.15, fetch=fetch, ids=ids)
            eng.release(seq)
            assert stats.store_hits == 2 and client.reads["arena-device"] == 2
            assert stats.load_failures == int(damage) and client.fallbacks["damaged"] == int(damage)
            assert torch.allclose(logits, want, atol=1e-4, rtol=1e-4)
        finally:
            access.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["even", "padded", "ragged", "one"])
def test_a_groups_layer_views_are_the_bytes_per_layer_slicing_gives(dtype, layout):
    """``client._group_views`` cuts equally spaced layers of one shape from two strided views; each (K, V) is the same
    view of the same bytes as slicing each layer on its own gives (values, shape, strides, address), whatever the
    layout: back to back, padded to an alignment, layers of different shapes (sliced one by one), one layer."""
    from services.kvstore import client as client_module
    from services.kvstore.chunk import ChunkMeta

    item = dtype.itemsize
    shapes = {"even": [(5, 3, 8)] * 4, "padded": [(5, 3, 8)] * 4, "ragged": [(5, 3, 8), (7, 3, 8), (5, 3, 8)],
              "one": [(9, 2, 4)]}[layout]
    kv = [(s, (s[0], s[1], s[2] + (2 if layout == "ragged" else 0))) for s in shapes]
    pad = 96 if layout == "padded" else 0
    spans, at = [], 0
    for i, (ks, vs) in enumerate(kv):
        n = (int(torch.tensor(ks).prod()) + int(torch.tensor(vs).prod())) * item
        spans.append((i + 3, 1000 + at, n))          # the group's layers 3.., at arena offsets from 1000
        at += n + pad
    meta = ChunkMeta("c" * 64, "m", {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype],
                     tuple([(1, 1, 1)] * 3 + [k for k, _ in kv]), tuple([(1, 1, 1)] * 3 + [v for _, v in kv]))
    data = torch.randint(0, 256, (spans[-1][1] - 1000 + spans[-1][2],), dtype=torch.uint8)

    class Calls(torch.overrides.TorchFunctionMode):
        n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Calls.n += 1
            return func(*args, **(kwargs or {}))

    with Calls():
        got = client_module._group_views(data, spans, meta, dtype)
    if layout in ("even", "padded"):      # the point: torch calls a group, not a layer
        assert Calls.n <= 8 < 6 * len(spans)
    assert [i for i, _, _ in got] == [i for i, _, _ in spans]
    for (index, k, v), (_, offset, nbytes) in zip(got, spans):
        rel, kn = offset - 1000, meta.k_nbytes(index)
        want_k = data[rel:rel + kn].view(dtype).reshape(meta.k_shapes[index])
        want_v = data[rel + kn:rel + nbytes].view(dtype).reshape(meta.v_shapes[index])
        for t, want in ((k, want_k), (v, want_v)):
            assert t.shape == want.shape and t.stride() == want.stride() and t.is_contiguous()
            assert t.data_ptr() == want.data_ptr()
            assert torch.equal(t.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_device_read_lands_and_is_checked_without_waiting_for_the_callers_stream(start_store, shm_dir):  # noqa: F811
    """The copies land on a stream of their own: a read made while the caller's stream is busy is verified before
    that work ends (a prefill worker issues a pass's loads while the pass ahead still runs), and the caller's stream
    reads the landed layers only after their copies."""
    srv, plain = arena_store(start_store, shm_dir)
    layers = make_layers(n_layers=4, tokens=64, heads=2, dim=32, seed=23)
    plain.put("doc-w", layers)
    device = torch.device("cuda")
    with KVStoreClient(srv.address, timeout=30, local=True) as local:
        [loc] = local.lookup(["doc-w"])
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)          # ~1 s of the current stream busy
        busy = torch.cuda.Event()
        busy.record()
        read = local.device_read("doc-w", loc.place, device)
        got = [(i, k.clone(), v.clone()) for i, k, v in read]     # on the current stream: after the copies
        read.verify()
        assert not busy.query(), "the read waited for the caller's stream"
        torch.cuda.synchronize()
        assert_same_layers([(i, k.cpu(), v.cpu()) for i, k, v in got], layers)
