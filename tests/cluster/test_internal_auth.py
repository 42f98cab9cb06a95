"""Internal traffic is mutual TLS from the cluster CA, each RPC allowed by role; a refused call changes
nothing stored, and the store never replaces a chunk it holds."""

from __future__ import annotations

import grpc
import pytest
import torch

from services.cluster.security import ClusterTLS, mint
from services.kvstore import KVStoreClient
from services.rpc import kvstore_pb2 as kv_pb
from services.rpc import tessera_pb2 as pb
from services.rpc import tessera_pb2_grpc as pb_grpc
from services.sdk import Client

from tests.helpers import InProcessCluster, docs


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    c = InProcessCluster(tiny_model, tmp_path_factory.mktemp("auth"), token="sesame")
    yield c
    c.stop()


def _addresses(cluster) -> dict[str, str]:
    return {"store": cluster.store.address, "prefill": cluster.workers[0][2], "decode": cluster.workers[1][2]}


def _channel(address: str, peer: str, tls: ClusterTLS | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, tls.channel_credentials(), options=tls.channel_options(peer))


def _calls(ch: grpc.Channel) -> dict[str, callable]:
    """One call per internal RPC a stranger could try, each harmless if it ran (but it must not)."""
    p, d = pb_grpc.PrefillWorkerStub(ch), pb_grpc.DecodeWorkerStub(ch)
    prefill = pb.PrefillRequest(request_id="x", suffix=[1, 2], decode_address="127.0.0.1:9")
    return {
        "prefill.Prefill": lambda: list(p.Prefill(prefill, timeout=5)),
        "prefill.Warm": lambda: p.Warm(pb.WarmRequest(chunks=[pb.TokenIds(ids=[1, 2, 3])]), timeout=5),
        "prefill.Reset": lambda: p.Reset(pb.ResetRequest(), timeout=5),
        "prefill.Status": lambda: p.Status(pb.WorkerStatusRequest(), timeout=5),
        "decode.Decode": lambda: list(d.Decode(pb.DecodeRequest(request_id="x"), timeout=5)),
        "decode.PushHandoff": lambda: d.PushHandoff(iter([pb.HandoffPart()]), timeout=5),
        "decode.Reset": lambda: d.Reset(pb.ResetRequest(), timeout=5),
        "decode.Prefetch": lambda: d.Prefetch(pb.PrefetchRequest(chunk_ids=["a" * 64]), timeout=5),
        "decode.Status": lambda: d.Status(pb.WorkerStatusRequest(), timeout=5),
    }


def _code(fn) -> grpc.StatusCode | None:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code()
    return None


def test_a_caller_without_a_cluster_certificate_reaches_nothing(cluster, tmp_path):
    """Plain channels and certificates of another CA fail the handshake: no RPC runs."""
    other = mint(tmp_path / "other")
    for role, address in _addresses(cluster).items():
        for tls in (None, ClusterTLS.load(other, "gateway")):
            with _channel(address, role, tls) as ch:
                if role == "store":
                    with KVStoreClient(address, tls=tls, timeout=5) as c:
                        assert _code(lambda: c.lookup(["a" * 64])) == grpc.StatusCode.UNAVAILABLE
                        assert _code(lambda: c.delete("a" * 64)) == grpc.StatusCode.UNAVAILABLE
                    continue
                for name, fn in _calls(ch).items():
                    if name.startswith(role):
                        assert _code(fn) == grpc.StatusCode.UNAVAILABLE, (name, tls)


# who may call what (services/cluster/security.py POLICY); everything else is PERMISSION_DENIED
ALLOWED = {"gateway": {"prefill.Prefill", "prefill.Warm", "prefill.Reset", "prefill.Status", "decode.Decode",
                       "decode.Reset", "decode.Prefetch", "decode.Status"},
           "prefill": {"decode.PushHandoff", "decode.Status"},
           "admin": {"prefill.Status", "decode.Status"}}


@pytest.mark.parametrize("role", ["store", "decode", "prefill", "admin", "index"])
def test_each_role_calls_only_what_it_is_allowed_to(cluster, role):
    tls = ClusterTLS.load(cluster.certs, role)
    for peer in ("prefill", "decode"):
        with _channel(_addresses(cluster)[peer], peer, tls) as ch:
            for name, fn in _calls(ch).items():
                if not name.startswith(peer):
                    continue
                code = _code(fn)
                if name in ALLOWED.get(role, ()):
                    assert code != grpc.StatusCode.PERMISSION_DENIED, name
                else:
                    assert code == grpc.StatusCode.PERMISSION_DENIED, (role, name, code)


def test_a_server_must_prove_the_role_it_was_dialled_as(cluster):
    """The gateway dials a prefill worker expecting role prefill: the store's certificate does not pass."""
    tls = ClusterTLS.load(cluster.certs, "gateway")
    with _channel(cluster.store.address, "prefill", tls) as ch:
        assert _code(_calls(ch)["prefill.Status"]) == grpc.StatusCode.UNAVAILABLE


def test_store_writes_are_refused_to_all_but_prefill_workers_and_never_replace_a_chunk(cluster, reference):
    """The poisoning attack: Put under an existing chunk id (same shapes, other values, matching crc32).
    Refused to every role but prefill's; from a prefill certificate it is acknowledged and writes nothing.
    A later request reading the chunk from the store returns the same tokens as before."""
    chunks, suffix = docs(2, 40, seed=21), [3, 4]
    with Client(cluster.address, token=cluster.token, timeout=60) as c:
        before = list(c.complete(chunks, suffix, max_new_tokens=8, stop_token_ids=[]).token_ids)
        cid = reference.chunk_id(chunks[0])
        with KVStoreClient(cluster.store.address, tls=ClusterTLS.load(cluster.certs, "prefill")) as prefill:
            assert prefill.lookup([cid])[0].found
            layers = [(torch.randn_like(k), torch.randn_like(v)) for _, k, v in prefill.get(cid)]
            stored = [(k.clone(), v.clone()) for _, k, v in prefill.get(cid)]
            for role in ("gateway", "decode", "admin", "store"):     # a decode worker writes retrieval indexes only
                with KVStoreClient(cluster.store.address, tls=ClusterTLS.load(cluster.certs, role)) as other:
                    assert _code(lambda: other.put(cid, layers)) == grpc.StatusCode.PERMISSION_DENIED, role
                    assert _code(lambda: other.delete(cid)) == grpc.StatusCode.PERMISSION_DENIED, role
            got = prefill.put(cid, layers)
            assert got.already_stored and got.nbytes == 0
            after = [(k, v) for _, k, v in prefill.get(cid)]
            assert all(torch.equal(a, b) and torch.equal(x, y) for (a, x), (b, y) in zip(stored, after))
        c.reset_caches(device_only=True)       # the workers drop their device copies: the store's is read
        again = c.complete(chunks, suffix, max_new_tokens=8, stop_token_ids=[])
        assert list(again.token_ids) == before
        tiers = dict(again.stats.chunk_tokens_by_tier)
        assert tiers.get("gpu", 0) == 0 and tiers.get("computed", 0) == 0, tiers   # read from the store


def test_a_handlers_unexpected_error_is_internal_with_an_id_never_its_text():
    """gRPC answers an exception a handler let through as UNKNOWN with the exception's text; the guard
    turns it into INTERNAL naming an error id whose cause is in the service's log."""
    from services.cluster.serving import LoopThread, make_server

    async def boom(request, context):
        raise KeyError("secret-internal-state")

    async def boom_stream(request, context):
        yield b"first"
        raise ValueError("secret-internal-state")

    handlers = {"Boom": grpc.unary_unary_rpc_method_handler(boom),
                "BoomStream": grpc.unary_stream_rpc_method_handler(boom_stream)}
    loop = LoopThread("guard-test")

    async def start():
        server = make_server("test service")
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", handlers),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port
    server, port = loop.run(start())
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            for call in (lambda: ch.unary_unary("/t.T/Boom")(b"x", timeout=5),
                         lambda: list(ch.unary_stream("/t.T/BoomStream")(b"x", timeout=5))):
                with pytest.raises(grpc.RpcError) as info:
                    call()
                assert info.value.code() == grpc.StatusCode.INTERNAL
                details = info.value.details()
                assert "internal error " in details and "test service" in details
                assert "secret-internal-state" not in details and "Error" not in details
    finally:
        loop.run(server.stop(0))
        loop.stop()


@pytest.mark.parametrize("nixl, says", [
    (pb.NixlBuffer(offer=b"NXOF" + b"\0" * 30, dtype="float32", numel=4), "not a NIXL offer"),
    (pb.NixlBuffer(offer=b"x", dtype="no_such_dtype", numel=4), "NIXL buffer of dtype 'no_such_dtype'"),
    (pb.NixlBuffer(offer=b"x", dtype="float32", numel=0), "and 0 elements"),
])
def test_a_hand_off_naming_a_bad_nixl_buffer_is_refused_and_the_decode_worker_serves_on(cluster, nixl, says):
    """A prefill worker's hand-off whose K/V are to be read over NIXL, with an offer or buffer that cannot be: DATA_LOSS
    naming why, nothing kept (refused before any NIXL agent is made), and the worker still answers."""
    _refused_push(cluster, pb.HandoffHeader(request_id="bad-nixl", kind="engine", nixl=nixl), says)


def _refused_push(cluster, header: pb.HandoffHeader, says: str) -> None:
    """A prefill worker's push of ``header`` is DATA_LOSS with ``says`` in its details, and the decode worker still
    answers, holding nothing in flight."""
    from services.handoff.transport import handoff_parts

    tls = ClusterTLS.load(cluster.certs, "prefill")
    with _channel(_addresses(cluster)["decode"], "decode", tls) as ch:
        d = pb_grpc.DecodeWorkerStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            d.PushHandoff(handoff_parts(header, b"payload"), timeout=10)
        assert err.value.code() == grpc.StatusCode.DATA_LOSS and says in err.value.details()
        assert d.Status(pb.WorkerStatusRequest(), timeout=5).in_flight == 0


@pytest.mark.parametrize("role", ["gateway", "index", "admin", "store"])
def test_a_role_the_store_does_not_serve_learns_no_chunk_and_no_file(cluster, role):
    """A Get asking for the shared-memory file (local_host) is refused before the store looks anything up."""
    from services.hostid import host_id

    tls = ClusterTLS.load(cluster.certs, role)
    client = KVStoreClient(cluster.store.address, tls=tls, local=True)
    try:
        with pytest.raises(grpc.RpcError) as err:
            list(client._get(kv_pb.GetRequest(chunk_id="a" * 64, local_host=host_id()), timeout=10))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and client.local_reads == 0
    finally:
        client.close()


def test_a_decode_worker_stores_and_deletes_retrieval_indexes_and_nothing_else(cluster):
    """Under mutual TLS a decode worker may keep a chunk's retrieval indexes (uint8 entries) in the store, delete
    them, and never write or delete KV; a refused put stores nothing."""
    from services.engine.kv.chunk_ids import index_entry_id

    decode = KVStoreClient(cluster.store.address, tls=ClusterTLS.load(cluster.certs, "decode"))
    prefill = KVStoreClient(cluster.store.address, tls=ClusterTLS.load(cluster.certs, "prefill"))
    try:
        entry = index_entry_id("c" * 64)
        blob = bytes(range(256)) * 40
        assert decode.put_bytes(entry, blob).nbytes == len(blob)
        assert decode.get_bytes(entry) == blob
        kv_id = "d" * 64
        kv = [(torch.randn(4, 2, 8).to(torch.bfloat16), torch.randn(4, 2, 8).to(torch.bfloat16))]
        assert _code(lambda: decode.put(kv_id, kv)) == grpc.StatusCode.PERMISSION_DENIED
        assert not prefill.lookup([kv_id])[0].found                    # nothing stored
        prefill.put(kv_id, kv)
        assert _code(lambda: decode.delete(kv_id)) == grpc.StatusCode.PERMISSION_DENIED
        assert prefill.lookup([kv_id])[0].found                        # still there
        assert decode.delete(entry) and not prefill.lookup([entry])[0].found
        assert not decode.delete("e" * 64)                             # nothing there: nothing to refuse
    finally:
        prefill.delete(kv_id)
        decode.close()
        prefill.close()


@pytest.mark.parametrize("kv, says", [
    (pb.CudaIpcBuffer(dtype="bfloat16", numel=8, slab=True, device_uuid="GPU-not-here"), "does not see"),
    (pb.CudaIpcBuffer(dtype="no_such_dtype", numel=8, slab=True), "unknown dtype 'no_such_dtype'"),
])
def test_a_hand_off_naming_a_cuda_ipc_slab_piece_it_cannot_open_is_refused_and_the_decode_worker_serves_on(
        cluster, kv, says):
    """A hand-off whose K/V are a piece of a sender's CUDA IPC slab that this decode worker cannot open (a GPU it does
    not see, a dtype that is none): DATA_LOSS naming why, and the worker still answers."""
    _refused_push(cluster, pb.HandoffHeader(request_id="bad-slab", kind="engine", kv=kv), says)
