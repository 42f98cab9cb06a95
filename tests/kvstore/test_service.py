"""The gRPC surface: status codes for bad input, partial puts, deadlines, concurrency, health,
reflection and /metrics."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
import zlib

import grpc
import pytest
import torch

from services.kvstore.client import KVStoreClient, _raw
from services.kvstore.wire import Frame
from services.rpc import kvstore_pb2 as pb
from services.rpc import kvstore_pb2_grpc as pb_grpc

from .helpers import MiB, assert_roundtrip, make_layers, same_bytes

SHAPE = dict(n_layers=3, tokens=32, heads=2, dim=64)


def requests_for(client: KVStoreClient, chunk_id: str, layers) -> list[pb.PutRequest]:
    """The client's put stream as generated-protobuf messages (so tests can edit them); a small
    ``frame_bytes`` client cuts each layer in pieces."""
    out = []
    for item in client._put_requests(client._header(chunk_id, layers, ""), layers):
        if isinstance(item, bytes):          # a whole layer, already serialized
            item = pb.PutRequest.FromString(item)
        elif isinstance(item, Frame):
            item = pb.PutRequest(frame=pb.LayerFrame(layer_index=item.layer_index, data=bytes(item.data),
                                                     end_of_layer=item.end_of_layer, checksum=item.checksum))
        out.append(item)
    return out


def raw_put(address: str, requests, timeout: float = 10.0):
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.KVStoreStub(ch).Put(iter(requests), timeout=timeout)


def status_of(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code()


@pytest.fixture
def store(start_store):
    srv, c = start_store(dram_bytes=16 * MiB)
    keep = make_layers(seed=42, **SHAPE)
    c.put("kept", keep)
    yield srv, c
    assert_roundtrip(c, "kept", keep)     # no bad request harmed what was stored


def test_unknown_chunk_is_not_found(store):
    _, c = store
    assert status_of(lambda: list(c.get("missing"))) == grpc.StatusCode.NOT_FOUND
    assert c.delete("missing") is False
    assert c.lookup(["missing", "kept"])[0].found is False


def _mutations(c):
    layers = make_layers(seed=1, **SHAPE)
    good = requests_for(c, "bad", layers)
    header = good[0].header

    def with_header(**changes):
        h = pb.ChunkHeader()
        h.CopyFrom(header)
        for key, value in changes.items():
            if key == "layers":
                del h.layers[:]
                h.layers.extend(value)
            else:
                setattr(h, key, value)
        return [pb.PutRequest(header=h), *good[1:]]

    frames = good[1:]                   # one message per layer
    swapped = [good[0], frames[1], frames[0], *frames[2:]]   # layer 1 before layer 0
    fat = pb.PutRequest(frame=pb.LayerFrame(layer_index=0, data=b"\0" * 64))
    wrong_shape = [pb.LayerShape(k_shape=[32, 2, 65], v_shape=[32, 2, 64])] + list(header.layers[1:])
    return {
        "no-header": good[1:],
        "two-headers": [good[0], good[0], *good[1:]],
        "bad-dtype": with_header(dtype=pb.DTYPE_UNSPECIFIED),
        "bad-checksum-algorithm": with_header(checksum_algorithm=pb.CHECKSUM_UNSPECIFIED),
        "layer-count-mismatch": with_header(num_layers=4),
        "zero-dim": with_header(layers=[pb.LayerShape(k_shape=[0, 2, 64], v_shape=[32, 2, 64])] + list(header.layers[1:])),
        "bad-chunk-id": with_header(chunk_id="../../etc/passwd"),
        "shape-mismatch": with_header(layers=wrong_shape),
        "layers-out-of-order": swapped,
        "too-many-bytes": [good[0], fat, *good[1:]],
        "frame-after-last-layer": [*good, good[1]],
        "ends-early": good[:3],
        "empty": [],
    }


@pytest.mark.parametrize("case", ["no-header", "two-headers", "bad-dtype", "bad-checksum-algorithm", "layer-count-mismatch",
                                  "zero-dim", "bad-chunk-id", "shape-mismatch", "layers-out-of-order", "too-many-bytes",
                                  "frame-after-last-layer", "ends-early", "empty"])
def test_malformed_put_is_invalid_argument_and_stores_nothing(store, case):
    srv, c = store
    requests = _mutations(c)[case]
    assert status_of(lambda: raw_put(srv.address, requests)) == grpc.StatusCode.INVALID_ARGUMENT
    assert not c.lookup(["bad"])[0].found


def test_layer_failing_its_checksum_in_transit_is_data_loss(store):
    srv, c = store
    requests = requests_for(c, "bad", make_layers(seed=1, **SHAPE))
    last = requests[2].frame
    assert last.end_of_layer and last.layer_index == 1
    last.checksum ^= 1
    assert status_of(lambda: raw_put(srv.address, requests)) == grpc.StatusCode.DATA_LOSS
    assert not c.lookup(["bad"])[0].found


def test_a_put_laid_out_by_protobuf_is_stored_too(store):
    """Another client's put (protobuf's layout: no aligned payload, or layers in pieces) is
    copied into the stored layout, served the same."""
    srv, c = store
    layers = make_layers(seed=5, **SHAPE)
    raw_put(srv.address, requests_for(c, "whole", layers))
    pieces = KVStoreClient(srv.address, frame_bytes=4096)
    raw_put(srv.address, requests_for(pieces, "pieces", layers))
    pieces.close()
    assert_roundtrip(c, "whole", layers)
    assert_roundtrip(c, "pieces", layers)


def test_bad_get_arguments(store):
    _, c = store
    assert status_of(lambda: list(c.get("kept", layers=(1, 9)))) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(lambda: list(c.get("no/slash"))) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(lambda: c.lookup(["ok", ""])) == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(ValueError):
        c.put("x", [(torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))])


def test_a_put_that_dies_midway_leaves_nothing(store):
    srv, c = store
    requests = requests_for(c, "dies", make_layers(seed=1, **SHAPE))

    def dying():
        yield from requests[:3]
        raise RuntimeError("worker crashed mid-put")

    with pytest.raises(grpc.RpcError) as err:
        raw_put(srv.address, dying())
    assert err.value.code() in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED)
    assert not c.lookup(["dies"])[0].found
    assert status_of(lambda: list(c.get("dies"))) == grpc.StatusCode.NOT_FOUND


@pytest.mark.slow
def test_put_deadline_is_honoured_and_stores_nothing(store):
    srv, c = store
    requests = requests_for(c, "slow", make_layers(seed=1, **SHAPE))

    def stalling():
        yield from requests[:3]
        time.sleep(1.5)                    # the client's deadline passes mid-put
        yield from requests[3:]

    assert status_of(lambda: raw_put(srv.address, stalling(), timeout=0.5)) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert not c.lookup(["slow"])[0].found


def test_concurrent_puts_and_gets_of_one_chunk_never_mix_versions(start_store):
    _, c = start_store(dram_bytes=32 * MiB)
    versions = [make_layers(seed=s, n_layers=4, tokens=64, heads=8, dim=64) for s in (1, 2)]
    c.put("shared", versions[0])
    errors, seen = [], set()

    def writer(v):
        try:
            for _ in range(6):
                c.put("shared", versions[v])
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def reader():
        try:
            for _ in range(10):
                got = list(c.get("shared"))
                match = [v for v, layers in enumerate(versions)
                         if all(same_bytes(k, layers[i][0]) and same_bytes(vv, layers[i][1]) for i, k, vv in got)]
                assert len(got) == 4 and len(match) == 1, "a get mixed layers of two versions"
                seen.add(match[0])
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(v,)) for v in (0, 1)] + [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert seen and c.lookup(["shared"])[0].found


def test_health_reflection_and_metrics(start_store):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    srv, c = start_store(dram_bytes=8 * MiB, metrics_port=0)
    layers = make_layers(seed=3, **SHAPE)
    c.put("m", layers)
    list(c.get("m"))
    with pytest.raises(grpc.RpcError):
        list(c.get("absent"))
    with grpc.insecure_channel(srv.address) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="tessera.kvstore.v1.KVStore"), timeout=5)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        services = ProtoReflectionDescriptorDatabase(ch).get_services()
        assert "tessera.kvstore.v1.KVStore" in services and "grpc.health.v1.Health" in services
    text = urllib.request.urlopen(f"http://127.0.0.1:{srv.server.metrics_port}/metrics", timeout=5).read().decode()
    nbytes = sum(_raw(k).size + _raw(v).size for k, v in layers)
    assert 'tessera_kvstore_hits_total{tier="dram"} 1.0' in text
    assert 'tessera_kvstore_misses_total{tier="dram"} 1.0' in text
    assert f'tessera_kvstore_resident_bytes{{tier="dram"}} {float(nbytes)}' in text
    assert f'tessera_kvstore_read_bytes_total{{tier="dram"}} {float(nbytes)}' in text
    assert 'tessera_kvstore_budget_bytes{tier="dram"} 8.388608e+06' in text
    assert 'tessera_kvstore_get_seconds_count{tier="dram"} 1.0' in text
    assert "tessera_kvstore_put_seconds_count 1.0" in text
    assert 'tessera_kvstore_get_first_layer_seconds_bucket{le="+Inf",tier="dram"} 1.0' in text
    with pytest.raises(urllib.error.HTTPError) as info:     # only /metrics: any other path is not found
        urllib.request.urlopen(f"http://127.0.0.1:{srv.server.metrics_port}/secrets", timeout=5)
    assert info.value.code == 404


def test_client_rejects_a_corrupted_stream():
    """The client checks each layer's checksum itself, end to end."""
    layers = make_layers(seed=4, **SHAPE)
    c = KVStoreClient("127.0.0.1:1")
    reqs = requests_for(c, "x", layers)
    from services.kvstore.chunk import ChunkMeta

    meta = ChunkMeta.from_proto(reqs[0].header).with_checksums(
        [zlib.crc32(_raw(v), zlib.crc32(_raw(k))) for k, v in layers])
    frames = [pb.GetResponse(frame=r.frame) for r in reqs[1:]]
    bad = pb.GetResponse()
    bad.CopyFrom(frames[0])
    bad.frame.data = bytes([bad.frame.data[0] ^ 1]) + bad.frame.data[1:]
    from services.kvstore.client import ChunkCorruptError

    stream = [pb.GetResponse(header=meta.to_proto()), bad, *frames[1:]]
    with pytest.raises(ChunkCorruptError, match="checksum"):
        list(c._assemble("x", iter(stream)))
    assert len(list(c._assemble("x", iter([pb.GetResponse(header=meta.to_proto()), *frames])))) == 3
    c.close()


def test_cli_refuses_bad_flags(tmp_path, capsys):
    from services.cli import main

    assert main(["kvstore", "serve", "--port", "0", "--dram-bytes", "1G", "--rocksdb-dir", str(tmp_path / "d"),
                 "--s3-endpoint", "http://127.0.0.1:9"]) == 2
    assert "--s3-endpoint and --s3-bucket go together" in capsys.readouterr().err
    assert main(["kvstore", "serve", "--port", "0", "--dram-bytes", "0", "--rocksdb-dir", str(tmp_path / "d")]) == 2
    with pytest.raises(SystemExit):
        main(["kvstore", "serve", "--port", "0", "--dram-bytes", "lots", "--rocksdb-dir", str(tmp_path / "d")])
    assert main(["kvstore", "serve", "--port", "0", "--dram-bytes", "1G", "--rocksdb-dir", str(tmp_path / "d"),
                 "--certs-dir", str(tmp_path / "no-certs")]) == 2
    assert "cluster certificates missing" in capsys.readouterr().err


@pytest.mark.slow
def test_get_deadline_is_honoured_and_the_chunk_stays(start_store):
    srv, c = start_store(dram_bytes=1 * MiB, rocksdb_dir="tmp", rocksdb_bytes=8 * MiB)
    layers = make_layers(seed=7, **SHAPE)
    c.put("slowly", layers), c.put("evictor", make_layers(seed=8, n_layers=4, tokens=64, heads=8, dim=128))
    rocks = next(s for s in srv.server.store.slots if s.name == "rocksdb").storage
    real_read = rocks.read_layer

    def slow_read(chunk_id, index):
        time.sleep(0.4)                    # a slow disk: the whole get cannot fit in the deadline
        return real_read(chunk_id, index)
    rocks.read_layer = slow_read
    assert status_of(lambda: list(c.get("slowly", timeout=0.5))) == grpc.StatusCode.DEADLINE_EXCEEDED
    rocks.read_layer = real_read
    assert_roundtrip(c, "slowly", layers)
