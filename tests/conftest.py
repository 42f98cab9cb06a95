"""Suite-wide settings.

NOTE: Triton kernels run on the CPU through Triton's interpreter, which must be chosen before
anything imports triton (the engine imports it lazily, the kernel tests eagerly); setdefault lets a
GPU machine run the same tests compiled with TRITON_INTERPRET=0.

Tests marked ``cuda`` run a GPU with the kernels compiled for it: they are skipped, with the reason,
where there is no CUDA GPU and where Triton interprets (the interpreter runs kernels on host arrays, so
the GPU tests need ``TRITON_INTERPRET=0``: ``TRITON_INTERPRET=0 make test`` on a GPU machine).

The services' fixtures (a tiny model, the reference engine, one local Ray per session, the services run in this
process) are here because the gateway, prefill, decode, cluster, launch, sdk, e2e and fuzz tests share them.
Servers listen on 127.0.0.1. A Ray cluster costs ~20 s to start on 2 cores, so there is one local Ray per test
session and one cluster per module that needs it; modules that only exercise the gateway and the SDK run the
services in this process instead (``InProcessCluster``, tests/helpers.py).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def _cuda_skip_reason() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "a GPU test with TRITON_INTERPRET=1 (Triton's interpreter cannot run kernels on the GPU): run with TRITON_INTERPRET=0"
    return None


def pytest_collection_modifyitems(config, items):
    cuda = [item for item in items if item.get_closest_marker("cuda") is not None]
    reason = _cuda_skip_reason() if cuda else None
    if reason is not None:
        for item in cuda:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from services.engine.model.tiny import write_tiny

    from tests.helpers import MAX_POSITIONS

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
    from tests.helpers import InProcessCluster

    cluster = InProcessCluster(tiny_model, tmp_path_factory.mktemp("rocksdb"), token="sesame")
    yield cluster
    cluster.stop()
