"""Fixtures of the KV store tests: stores served on 127.0.0.1 from a thread, an S3 server (moto)."""

from __future__ import annotations

import socket
import uuid

import pytest

from services.kvstore import BackgroundServer, KVStoreClient, S3Config, StoreConfig

from .helpers import MiB


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    """An S3-protocol server (moto) on a free loopback port, for the whole session."""
    from moto.server import ThreadedMotoServer

    mp = pytest.MonkeyPatch()
    for key, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):
        mp.setenv(key, value)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()
    mp.undo()


@pytest.fixture
def s3_config(s3_endpoint):
    """A fresh bucket per test, so tests do not see each other's objects."""
    return S3Config(endpoint_url=s3_endpoint, bucket=f"kv-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def start_store(tmp_path):
    """start_store(**StoreConfig fields) -> (BackgroundServer, KVStoreClient); stopped at teardown."""
    started = []

    def start(metrics_port=None, **fields):
        fields.setdefault("dram_bytes", 64 * MiB)
        if fields.get("rocksdb_dir") == "tmp":
            fields["rocksdb_dir"] = str(tmp_path / "rocksdb")
        srv = BackgroundServer(StoreConfig(**fields), metrics_port=metrics_port)
        client = KVStoreClient(srv.address, timeout=30)
        started.append((srv, client))
        return srv, client

    yield start
    for srv, client in started:
        client.close()
        srv.stop()
