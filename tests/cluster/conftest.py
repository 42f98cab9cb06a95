"""Fixtures of the cluster tests: a tiny model, a reference engine, in-process servers and Ray clusters.

Servers listen on 127.0.0.1. A Ray cluster costs ~20 s to start on 2 cores, so there is one
local Ray per test session and one cluster per module that needs it; modules that only exercise
the gateway and the SDK run the services in this process instead (``InProcessCluster``).
"""

from __future__ import annotations

import pytest

from .helpers import MAX_POSITIONS, InProcessCluster


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from services.engine.model.tiny import write_tiny

    return str(write_tiny(tmp_path_factory.mktemp("model") / "tiny", max_position_embeddings=MAX_POSITIONS))


@pytest.fixture(scope="session")
def reference(tiny_model):
    """The engine every cluster output is compared with (greedy: token for token)."""
    from services.engine import Engine

    return Engine.load(tiny_model, kv_cache_bytes=64 << 20)


@pytest.fixture(scope="session")
def local_ray():
    from services.launch.on_ray import ensure_ray

    import ray

    started = ensure_ray(num_cpus=6)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def inproc(tiny_model, tmp_path_factory):
    """Gateway (with a bearer token), one prefill, one decode and one store shard in this process."""
    cluster = InProcessCluster(tiny_model, tmp_path_factory.mktemp("rocksdb"), token="sesame")
    yield cluster
    cluster.stop()
