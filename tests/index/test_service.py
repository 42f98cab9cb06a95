"""The retrieval-index service (services/index/server.py) on loopback: an offload and a search through gRPC answer what
the in-process index set answers (exact attention when k covers every key); malformed offloads and searches are
refused with clear statuses, store nothing and leave the service serving; with the cluster's mutual TLS only the
roles the policy names get in. A decode engine using the service: tests/engine/decode/test_retrieval.py."""

from __future__ import annotations

import socket
import zlib

import grpc
import numpy as np
import pytest

from services.index.client import IndexClient
from services.index.heads import IndexSet
from services.index.server import BackgroundIndexServer
from services.rpc import index_pb2 as pb

HKV, N, D, M, HQ = 2, 300, 16, 200, 4


def _data(seed: int):
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((HKV, N, D)).astype(np.float32)
    values = rng.standard_normal((HKV, N, D)).astype(np.float32)
    train = (rng.standard_normal((HKV, M, D)) + 0.5).astype(np.float32)
    return keys, values, train


def _exact(keys, values, q, scale):
    """Attention of q [B, Hq, D] over every key of its KV head: out [B, Hq, D], lse [B, Hq]."""
    g = q.shape[1] // keys.shape[0]
    logits = np.einsum("bhd,hnd->bhn", q, np.repeat(keys, g, axis=0)).astype(np.float64) * scale
    top = logits.max(-1, keepdims=True)
    p = np.exp(logits - top)
    lse = top[..., 0] + np.log(p.sum(-1))
    return np.einsum("bhn,hnd->bhd", p / p.sum(-1, keepdims=True), np.repeat(values, g, axis=0)), lse


@pytest.fixture(scope="module")
def service():
    with BackgroundIndexServer(threads=2) as srv:
        yield srv


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def test_a_search_through_the_service_answers_what_the_index_set_does(service):
    keys, values, train = _data(1)
    q = np.random.default_rng(2).standard_normal((3, HQ, D)).astype(np.float32)
    local = IndexSet(threads=1)
    with IndexClient(service.address) as client:
        for ix in (local, client):
            ix.add("seq-a", 0, keys, values, train)
            ix.add("seq-b", 0, keys[:, :40], values[:, :40], train)
        owners = ["seq-a", "seq-b", "seq-a"]
        for k in (5, 10_000):
            want, got = local.attend(0, owners, q, k, 0.25), client.attend(0, owners, q, k, 0.25)
            np.testing.assert_allclose(got.out, want.out, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(got.lse, want.lse, rtol=1e-6, atol=1e-6)
            assert got.scanned.tolist() == want.scanned.tolist()
        # k covering every key is exact attention
        out, lse = _exact(keys, values, q[[0]], 0.25)
        full = client.attend(0, ["seq-a"], q[[0]], 10_000, 0.25)
        np.testing.assert_allclose(full.out, out, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(full.lse, lse, rtol=1e-5, atol=1e-5)
        assert client.held()[0] >= 2 and client.held()[1] > 0
        assert client.drop("seq-a") == 1 and client.drop("seq-b") == 1 and client.drop("seq-b") == 0
    local.close()


def _offload(client, header: pb.OffloadHeader, body: bytes, cut: int = 1 << 20):
    def parts():
        yield pb.OffloadPart(header=header)
        for at in range(0, len(body), cut):
            yield pb.OffloadPart(data=body[at:at + cut])
    return client._stub.Offload(parts(), timeout=10)


def test_malformed_offloads_are_refused_and_store_nothing(service):
    keys, values, train = _data(3)
    body = keys.tobytes() + values.tobytes() + train.tobytes()
    good = dict(owner="seq-c", layer=1, kv_shape=[HKV, N, D], train_shape=[HKV, M, D], crc32=zlib.crc32(body))
    with IndexClient(service.address) as client:
        before = client.held()
        bad_bytes = bytearray(body)
        bad_bytes[1234] ^= 0x40
        cases = [
            (dict(good), body[:-8], grpc.StatusCode.DATA_LOSS),                         # short
            (dict(good), bytes(bad_bytes), grpc.StatusCode.DATA_LOSS),                 # a flipped bit
            (dict(good), body + b"\0" * 4, grpc.StatusCode.INVALID_ARGUMENT),         # too long
            (dict(good, owner="../etc"), body, grpc.StatusCode.INVALID_ARGUMENT),
            (dict(good, owner=""), body, grpc.StatusCode.INVALID_ARGUMENT),
            (dict(good, kv_shape=[HKV, N]), body, grpc.StatusCode.INVALID_ARGUMENT),
            (dict(good, train_shape=[HKV + 1, M, D]), body, grpc.StatusCode.INVALID_ARGUMENT),
            (dict(good, layer=5000), body, grpc.StatusCode.INVALID_ARGUMENT),
            (dict(good, kv_shape=[HKV, 1 << 30, D]), body, grpc.StatusCode.INVALID_ARGUMENT),
        ]
        for fields, data, code in cases:
            assert _code(lambda: _offload(client, pb.OffloadHeader(**fields), data)) == code, fields
        nan = keys.copy()
        nan[0, 0, 0] = np.nan
        nan_body = nan.tobytes() + values.tobytes() + train.tobytes()
        assert _code(lambda: _offload(client, pb.OffloadHeader(**dict(good, crc32=zlib.crc32(nan_body))),
                                      nan_body)) == grpc.StatusCode.INVALID_ARGUMENT
        no_header = lambda: client._stub.Offload(iter([pb.OffloadPart(data=b"1234")]), timeout=10)  # noqa: E731
        assert _code(no_header) == grpc.StatusCode.INVALID_ARGUMENT
        assert client.held() == before                    # nothing of it kept
        client.add("seq-c", 1, keys, values, train)       # and the service still takes a good one
        held = client.held()
        assert _code(lambda: client.add("seq-c", 1, keys, values * 0, train)) == grpc.StatusCode.ALREADY_EXISTS
        assert client.held() == held
        q = np.ones((1, HQ, D), np.float32)
        kept = client.attend(1, ["seq-c"], q, 10_000, 0.1)
        np.testing.assert_allclose(kept.out, _exact(keys, values, q, 0.1)[0], rtol=1e-4, atol=1e-5)  # not zeroed
        client.drop("seq-c")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_held_keys_are_scanned_then_indexed_without_being_sent_again(dtype):
    """A hold's keys and values are searched exactly (scanned whole) before any index; the offload with keys_held
    then sends no keys and builds over the held ones: the service answers as an index set given the same calls."""
    keys, values, train = _data(11)
    q = np.random.default_rng(12).standard_normal((2, HQ, D)).astype(np.float32)
    local = IndexSet(threads=1, host_dtype=dtype)
    # warmed before it listens: a compile in its background would hold the GIL past a search's deadline
    with BackgroundIndexServer(threads=2, host_dtype=dtype) as srv, \
            IndexClient(srv.address, host_dtype=dtype, offload_timeout=300) as client:
        for ix in (local, client):
            ix.hold("seq-h", 2, keys, values)
        held = client.attend(2, ["seq-h", "seq-h"], q, 10, 0.3)
        want = local.attend(2, ["seq-h", "seq-h"], q, 10, 0.3)
        np.testing.assert_allclose(held.out, want.out, rtol=1e-6, atol=1e-6)
        assert held.scanned.tolist() == [HKV * N] * 2       # every key of each KV head (its group searched once)
        codes = client.held()[2]                # the held keys' int8 codes, no graph yet
        sent = []
        real = client._stub.Offload
        client._stub.Offload = lambda parts, **kw: real(iter(sent.append(p) or p for p in parts), **kw)
        client.add("seq-h", 2, keys, values, train)
        local.add("seq-h", 2, keys, values, train)
        body = sum(len(p.data) for p in sent if p.WhichOneof("item") == "data")
        assert body == train.nbytes, "no keys or values sent again"
        built, want = (ix.attend(2, ["seq-h", "seq-h"], q, 10, 0.3) for ix in (client, local))
        np.testing.assert_allclose(built.out, want.out, rtol=1e-6, atol=1e-6)
        assert built.scanned.tolist() == want.scanned.tolist() and client.held()[2] > codes
        client._stub.Offload = real
        # indexed now: neither a second build from held keys, nor a second offload or hold is taken; nothing changes
        before = client.held()
        tb = train.tobytes()
        again = pb.OffloadHeader(owner="seq-h", layer=2, kv_shape=[HKV, N, D], train_shape=[HKV, M, D],
                                 crc32=zlib.crc32(tb), keys_held=True, kv_dtype=dtype)
        assert _code(lambda: _offload(client, again, tb)) == grpc.StatusCode.FAILED_PRECONDITION
        assert _code(lambda: client.add("seq-h", 2, keys, values * 0, train)) == grpc.StatusCode.ALREADY_EXISTS
        assert _code(lambda: client.hold("seq-h", 2, keys, values * 0)) == grpc.StatusCode.ALREADY_EXISTS
        assert client.held() == before
        np.testing.assert_allclose(client.attend(2, ["seq-h"], q[:1], 10, 0.3).out, want.out[:1], rtol=1e-6, atol=1e-6)
        assert client.drop("seq-h") == 1
    local.close()


def test_malformed_holds_are_refused_and_store_nothing(service):
    keys, values, train = _data(13)
    kv = keys.tobytes() + values.tobytes()
    good = dict(owner="seq-m", layer=0, kv_shape=[HKV, N, D], train_shape=[HKV, 0, D], crc32=zlib.crc32(kv), hold=True)
    with IndexClient(service.address) as client:
        before = client.held()
        with_train = kv + train.tobytes()
        cases = [
            (dict(good, train_shape=[HKV, M, D], crc32=zlib.crc32(with_train)), with_train),   # training queries
            (dict(good, keys_held=True), kv),                                                    # both flags
            (dict(good, kv_shape=[HKV, 0, D], crc32=zlib.crc32(b"")), b""),                       # no key
            (dict(good, chunks=[pb.ChunkRun(chunk_id="c0", length=10)]), kv),                     # chunks
        ]
        for fields, data in cases:
            assert _code(lambda: _offload(client, pb.OffloadHeader(**fields), data)) == \
                grpc.StatusCode.INVALID_ARGUMENT, fields
        # keys_held with nothing held, and with a shape other than the held keys'
        tb = train.tobytes()
        build = dict(owner="seq-m", layer=0, kv_shape=[HKV, N, D], train_shape=[HKV, M, D], crc32=zlib.crc32(tb),
                     keys_held=True)
        assert _code(lambda: _offload(client, pb.OffloadHeader(**build), tb)) == grpc.StatusCode.FAILED_PRECONDITION
        assert client.held() == before
        client.hold("seq-m", 0, keys, values)
        assert _code(lambda: _offload(client, pb.OffloadHeader(**dict(build, kv_shape=[HKV, N - 1, D])), tb)) == \
            grpc.StatusCode.INVALID_ARGUMENT
        q = np.ones((1, HQ, D), np.float32)
        kept = client.attend(0, ["seq-m"], q, 10_000, 0.1)            # the hold is still scanned, unchanged
        np.testing.assert_allclose(kept.out, _exact(keys, values, q, 0.1)[0], rtol=1e-4, atol=1e-5)
        assert client.drop("seq-m") == 1 and client.held() == before


def test_bfloat16_on_the_wire_and_in_the_service_answers_what_an_index_set_holding_bfloat16_does():
    """A client sending bfloat16 (half the bytes) to a service holding bfloat16: what an in-process bfloat16 set
    answers, bit for bit; a float32 client's offload to it is rounded there alike. A bad or non-finite bfloat16 offload
    and an unknown kv_dtype are refused and store nothing."""
    from services.index import _layer, half

    _layer.warm("bfloat16")     # compiled first: a compile in the service's background holds the GIL past deadlines
    keys, values, train = _data(11)
    q = np.random.default_rng(12).standard_normal((2, HQ, D)).astype(np.float32)
    local = IndexSet(threads=1, host_dtype="bfloat16")
    # NOTE: deadlines of minutes: on a clean machine the first calls compile numba loops, the GIL held, while the
    # other test worker takes the second core (CI saw 30 s pass)
    with (BackgroundIndexServer(threads=2, host_dtype="bfloat16") as srv,
          IndexClient(srv.address, host_dtype="bfloat16", timeout=300) as narrow,
          IndexClient(srv.address, timeout=300) as wide):
        local.add("seq-a", 0, keys, values, train)
        narrow.add("seq-a", 0, keys, values, train)
        wide.add("seq-w", 0, keys, values, train)
        for k in (5, 10_000):
            want = local.attend(0, ["seq-a", "seq-a"], q, k, 0.25)
            for got in (narrow.attend(0, ["seq-a", "seq-a"], q, k, 0.25),
                        wide.attend(0, ["seq-w", "seq-w"], q, k, 0.25)):
                np.testing.assert_array_equal(got.out, want.out)
                np.testing.assert_array_equal(got.lse, want.lse)
        assert local.held()[1] == keys.nbytes                            # keys and values in 2 bytes each
        assert narrow.held()[1] == 2 * keys.nbytes                       # the service: seq-a and seq-w alike
        before = narrow.held()
        kv = half.to_bf16(keys).tobytes() + half.to_bf16(values).tobytes()
        body = kv + train.tobytes()
        good = dict(owner="seq-b", layer=0, kv_shape=[HKV, N, D], train_shape=[HKV, M, D], crc32=zlib.crc32(body),
                    kv_dtype="bfloat16")
        inf = bytearray(kv)
        inf[0:2] = np.array([0x7F80], "<u2").tobytes()
        inf_body = bytes(inf) + train.tobytes()
        cases = [
            (dict(good, kv_dtype="float16"), body, grpc.StatusCode.INVALID_ARGUMENT),        # no such dtype
            (dict(good, kv_dtype="float32"), body, grpc.StatusCode.DATA_LOSS),       # fewer bytes than it says: short
            (dict(good, crc32=zlib.crc32(inf_body)), inf_body, grpc.StatusCode.INVALID_ARGUMENT),   # an infinite key
        ]
        for fields, data, code in cases:
            assert _code(lambda: _offload(narrow, pb.OffloadHeader(**fields), data)) == code, fields
        assert narrow.held() == before
        _offload(narrow, pb.OffloadHeader(**good), body)              # the same, well formed, is taken
        assert narrow.held()[0] == before[0] + 1
    local.close()


def test_malformed_searches_are_refused_and_the_service_keeps_serving(service):
    keys, values, train = _data(4)
    with IndexClient(service.address) as client:
        client.add("seq-d", 0, keys, values, train)
        q = np.ones((1, HQ, D), np.float32)

        def search(**fields):
            req = pb.SearchRequest(layer=0, owners=["seq-d"], k=10, scale=0.1)
            req.queries.CopyFrom(pb.Tensor(shape=[1, HQ, D], data=q.tobytes()))
            for name, value in fields.items():
                if name == "queries":
                    req.queries.CopyFrom(value)
                elif name == "owners":
                    del req.owners[:]
                    req.owners.extend(value)
                else:
                    setattr(req, name, value)
            # a deadline that covers a cold process's first search: numba compiles its loops then (tens of seconds
            # on a 2-core machine compiling beside another test worker)
            return client._stub.Search(req, timeout=120)

        nan = q.copy()
        nan[0, 0, 0] = np.inf
        cases = [
            (dict(owners=["seq-x"]), grpc.StatusCode.NOT_FOUND),
            (dict(layer=3), grpc.StatusCode.NOT_FOUND),
            (dict(owners=[]), grpc.StatusCode.INVALID_ARGUMENT),
            (dict(owners=["seq-d", "seq-d"]), grpc.StatusCode.INVALID_ARGUMENT),          # B != owners
            (dict(queries=pb.Tensor(shape=[1, HQ, D + 1], data=np.ones((1, HQ, D + 1), np.float32).tobytes())),
             grpc.StatusCode.INVALID_ARGUMENT),                                            # wrong head_dim
            (dict(queries=pb.Tensor(shape=[1, 3, D], data=np.ones((1, 3, D), np.float32).tobytes())),
             grpc.StatusCode.INVALID_ARGUMENT),                                            # heads not shared evenly
            (dict(queries=pb.Tensor(shape=[1, HQ, D], data=b"123")), grpc.StatusCode.INVALID_ARGUMENT),
            (dict(queries=pb.Tensor(shape=[1, HQ, D], data=nan.tobytes())), grpc.StatusCode.INVALID_ARGUMENT),
            (dict(k=0), grpc.StatusCode.INVALID_ARGUMENT),
            (dict(scale=-1.0), grpc.StatusCode.INVALID_ARGUMENT),
            (dict(beam=3), grpc.StatusCode.INVALID_ARGUMENT),
        ]
        for fields, code in cases:
            assert _code(lambda: search(**fields)) == code, fields
        assert _code(lambda: client._channel.unary_unary(
            "/tessera.index.v1.RetrievalIndex/Search")(b"\xff\xff\xff", timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
        assert search().scanned[0] > 0                     # still serving
        client.drop("seq-d")


def test_only_the_roles_the_policy_names_get_in(tmp_path):
    from services.cluster.security import ClusterTLS, mint

    certs = mint(tmp_path / "certs")
    keys, values, train = _data(5)
    q = np.ones((1, HQ, D), np.float32)
    with BackgroundIndexServer(threads=1, tls=ClusterTLS.load(certs, "index")) as srv:
        as_role = {r: IndexClient(srv.address, tls=ClusterTLS.load(certs, r), timeout=10, offload_timeout=300)
                   for r in ("decode", "prefill", "gateway", "store")}
        as_role["prefill"].add("seq-e", 0, keys, values, train)
        assert as_role["decode"].attend(0, ["seq-e"], q, 5, 0.1).scanned[0] > 0
        for role in ("prefill", "gateway", "store"):
            assert _code(lambda: as_role[role].attend(0, ["seq-e"], q, 5, 0.1)) == grpc.StatusCode.PERMISSION_DENIED
        chunk = _chunk_index(keys)
        for role in ("gateway", "store"):
            assert _code(lambda: as_role[role].add("seq-f", 0, keys, values, train)) == \
                grpc.StatusCode.PERMISSION_DENIED
            assert _code(lambda: as_role[role].put_chunk_index("c" * 64, chunk)) == grpc.StatusCode.PERMISSION_DENIED
            assert _code(lambda: as_role[role].drop("seq-e")) == grpc.StatusCode.PERMISSION_DENIED
            assert _code(lambda: as_role[role].hold("seq-g", 0, keys, values)) == grpc.StatusCode.PERMISSION_DENIED
        assert as_role["gateway"].held()[0] == 1           # the refused calls changed nothing
        other = mint(tmp_path / "other")                   # a certificate of another CA reaches nothing
        stranger = IndexClient(srv.address, tls=ClusterTLS.load(other, "decode"), timeout=5)
        assert _code(lambda: stranger.held()) == grpc.StatusCode.UNAVAILABLE
        plain = IndexClient(srv.address, timeout=5)
        assert _code(lambda: plain.held()) == grpc.StatusCode.UNAVAILABLE
        for c in (*as_role.values(), stranger, plain):
            c.close()



def test_the_service_counts_what_it_builds_holds_and_searches_on_its_metrics_page():
    import urllib.request

    keys, values, train = _data(6)
    with BackgroundIndexServer(threads=1, metrics_port=0) as srv, IndexClient(srv.address) as client:
        client.add("seq-g", 0, keys, values, train)
        client.attend(0, ["seq-g", "seq-g"], np.ones((2, HQ, D), np.float32), 5, 0.1)
        page = urllib.request.urlopen(f"http://127.0.0.1:{srv.server.metrics_port}/metrics", timeout=10).read().decode()
        samples = {line.split(" ")[0]: float(line.split(" ")[1]) for line in page.splitlines()
                   if line and not line.startswith("#")}
        assert samples["tessera_index_owners"] == 1
        assert samples["tessera_index_kv_bytes"] == keys.nbytes + values.nbytes
        assert samples["tessera_index_index_bytes"] > 0
        assert samples["tessera_index_keys_offloaded_total"] == HKV * N
        assert samples["tessera_index_build_seconds_count"] == 1 and samples["tessera_index_search_seconds_count"] == 1
        assert samples["tessera_index_keys_scanned_total"] > 0
        # the one search call counted once, by the path that answered it (the pool while the compiled call compiles)
        assert (samples['tessera_index_search_calls_total{path="compiled"}']
                + samples['tessera_index_search_calls_total{path="pool"}']) == 1
        client.drop("seq-g")
        page = urllib.request.urlopen(f"http://127.0.0.1:{srv.server.metrics_port}/metrics", timeout=10).read().decode()
        assert "tessera_index_owners 0.0" in page


def _chunk_index(keys, length: int = 120, seed: int = 9):
    """A chunk index over the first ``length`` keys of each head (one layer), trained on shifted random queries."""
    from services.index.chunks import ChunkIndex

    rng = np.random.default_rng(seed)
    return ChunkIndex.build([keys[:, :length]], [rng.standard_normal((HKV, 100, D)).astype(np.float32) + 0.5],
                            threads=1)


def test_offloads_composed_of_chunk_indexes_answer_what_the_index_set_does_and_bad_chunk_indexes_are_refused(service):
    """The client puts a chunk's index once and names the chunk in its offloads; the service composes and repairs as
    the in-process set does. An offload naming a chunk the service lacks is FAILED_PRECONDITION (the client then
    puts it again); damaged index bytes are DATA_LOSS; neither stores anything."""
    keys, values, train = _data(11)
    chunk = _chunk_index(keys)
    q = np.random.default_rng(12).standard_normal((2, HQ, D)).astype(np.float32)
    local = IndexSet(threads=1)
    with IndexClient(service.address) as client:
        for ix in (local, client):
            ix.add("seq-c", 0, keys, values, train, chunks=[("c" * 64, chunk)])
        a, b = (ix.attend(0, ["seq-c", "seq-c"], q, 7, 0.25) for ix in (local, client))
        np.testing.assert_allclose(b.out, a.out, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(b.scanned, a.scanned)
        before = client.held()
        stub = client._stub
        header = pb.OffloadHeader(owner="seq-d", layer=0, kv_shape=list(keys.shape), train_shape=list(train.shape),
                                  chunks=[pb.ChunkRun(chunk_id="d" * 64, length=120)])
        body = b"".join(np.ascontiguousarray(x, "<f4").tobytes() for x in (keys, values, train))
        header.crc32 = zlib.crc32(body)
        offload = [pb.OffloadPart(header=header), pb.OffloadPart(data=body)]
        assert _code(lambda: stub.Offload(iter(offload))) == grpc.StatusCode.FAILED_PRECONDITION
        blob = bytearray(chunk.to_bytes())
        blob[len(blob) // 2] ^= 2
        put = [pb.ChunkIndexPart(header=pb.ChunkIndexHeader(chunk_id="d" * 64, nbytes=len(blob))),
               pb.ChunkIndexPart(data=bytes(blob))]
        assert _code(lambda: stub.PutChunkIndex(iter(put))) == grpc.StatusCode.DATA_LOSS
        short = [put[0], pb.ChunkIndexPart(data=bytes(blob[:-5]))]
        assert _code(lambda: stub.PutChunkIndex(iter(short))) == grpc.StatusCode.DATA_LOSS
        bad_id = [pb.ChunkIndexPart(header=pb.ChunkIndexHeader(chunk_id="../x", nbytes=4)),
                  pb.ChunkIndexPart(data=b"1234")]
        assert _code(lambda: stub.PutChunkIndex(iter(bad_id))) == grpc.StatusCode.INVALID_ARGUMENT
        assert _code(lambda: stub.Offload(iter(offload))) == grpc.StatusCode.FAILED_PRECONDITION   # still not held
        too_long = pb.OffloadHeader()
        too_long.CopyFrom(header)
        too_long.chunks[0].length = N + 1
        assert _code(lambda: stub.Offload(iter([pb.OffloadPart(header=too_long), offload[1]]))) == \
            grpc.StatusCode.INVALID_ARGUMENT
        assert client.held() == before
        client._put.add("d" * 64)   # the client believes it put the chunk: the service's answer makes it put it again
        client.add("seq-d", 0, keys, values, train, chunks=[("d" * 64, chunk)])
        assert client.held()[0] == before[0] + 1
        for owner in ("seq-c", "seq-d"):
            client.drop(owner)
    local.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_service_readies_its_compiled_loops_before_it_listens(monkeypatch, dtype):
    """``create_server(warm=True)`` (the default) runs services/index/warm.py for the dtype it holds before the port
    answers, so no caller's first offload or search waits for numba's compile; ``warm=False`` skips it; a dtype it
    cannot hold is refused before either."""
    from services.index import warm

    seen = []

    def record(dtypes, say=None):
        with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=2):
            pass                                # not listening yet
        seen.append(list(dtypes))
        return {t: 0.0 for t in dtypes}

    with socket.socket() as s:       # a free port, named before the server takes it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(warm, "warm", record)
    with BackgroundIndexServer(threads=1, port=port, host_dtype=dtype) as srv:
        assert seen == [[dtype]]
        with IndexClient(srv.address) as client:
            assert client.held() == (0, 0, 0)
    with BackgroundIndexServer(threads=1, host_dtype=dtype, warm=False):
        assert seen == [[dtype]]
    with pytest.raises(ValueError, match="host_dtype must be one of"):
        BackgroundIndexServer(threads=1, host_dtype="float16")
    assert seen == [[dtype]]
