"""Ray actor wrapper: one Tessera service (gateway, prefill, decode, store shard or retrieval index) per actor.

The actor's constructor starts the service's grpc.aio server on a loop thread and returns once
it serves; a restarted actor runs the constructor again with the same arguments and binds the
same port when it can (``serving.remembered_port``), so its peers reconnect on their own. Ray
restarts every crashed actor; a restarted constructor first counts itself against the cluster's
``RestartBudget`` and refuses to start when over it, which leaves the actor dead. Actor methods
are tiny and synchronous: address, ping, pid, node, stop.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.cluster.config import DecodeSettings, EngineSettings, PrefillSettings
from services.cluster.security import ClusterTLS
from services.cluster.serving import LoopThread, RayKV, advertised_host, remember_port, remembered_port

if TYPE_CHECKING:
    from services.kvstore.config import StoreConfig


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    """What one actor serves. Fields not used by a role stay None.

    store: StoreConfig; prefill/decode: engine + store_addresses + settings (decode: index_address too, when
    the cluster runs index services); index: index_threads; gateway: model_dir + workers [(name, role, address)]
    + token + namespace (to resolve restarts).
    """

    role: str
    name: str
    host: str = "127.0.0.1"
    port: int = 0
    store: StoreConfig | None = None
    engine: EngineSettings | None = None
    store_addresses: tuple[str, ...] = ()
    prefill: PrefillSettings | None = None
    decode: DecodeSettings | None = None
    model_dir: str | None = None
    workers: tuple[tuple[str, str, str], ...] = ()
    token: str | None = None
    tenants: dict | None = None                 # gateway: the tenants file's mapping (services/gateway/tenants.py)
    tls: tuple[bytes, bytes] | None = None      # gateway: (certificate chain PEM, private key PEM)
    cluster_tls: ClusterTLS | None = None       # this service's mutual-TLS identity (None: plain internal traffic)
    namespace: str = "tessera"
    text_cache_tokens: int = 8 << 20            # gateway: token ids of chunk texts kept (services/gateway/inputs.py)
    routing: str = "residency"                  # gateway: how prefill workers are picked (ClusterConfig.routing)
    index_address: str | None = None            # decode: its retrieval index service (None: indexes in process)
    index_threads: int = 0                      # index: threads building and searching (ClusterConfig.index_threads)
    index_host_dtype: str = "float32"           # index: how it holds offloaded K/V (ClusterConfig.index_host_dtype)


def gateway_tenants(spec: ServiceSpec):
    """The gateway's Tenants from its spec (None: one default tenant behind the token)."""
    from services.gateway.tenants import Tenants

    return Tenants.parse(spec.tenants) if spec.tenants is not None else None


def _resolver(namespace: str):
    """name -> the worker's address now; ``WorkerGone`` when Ray has no such actor alive any more (it stopped for
    good: its restarts ran out), any other error while it is restarting."""
    def resolve(name: str) -> str | None:
        import ray
        from ray.exceptions import ActorDiedError

        from services.gateway.peers import WorkerGone

        try:
            handle = ray.get_actor(name, namespace=namespace)
        except ValueError:
            raise WorkerGone(f"{name} is not alive in Ray (its restarts ran out, or it was stopped)") from None
        try:
            return ray.get(handle.address.remote(), timeout=5)
        except ActorDiedError as exc:
            raise WorkerGone(f"{name} died and is not being restarted: {exc}") from None
    return resolve


def _exit_for_restart() -> None:
    """A worker whose engine loop stopped for good ends its process: Ray then starts the actor again (a
    living process with a dead engine thread would keep its name and serve nothing)."""
    logging.getLogger(__name__).critical("exiting so that the worker is restarted")
    logging.shutdown()
    os._exit(70)


# A GPU worker's actor is started with Ray told not to narrow its CUDA_VISIBLE_DEVICES to the GPU it assigned: the
# worker then sees that GPU first and its node's others after it (``node_gpu_order``), so a decode worker opens the
# CUDA IPC hand-off buffers of prefill workers on the node's other GPUs and copies them GPU to GPU
NODE_GPUS_ENV = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}


def node_gpu_order(assigned: Sequence, inherited: str | None, node_gpus: int) -> str:
    """CUDA_VISIBLE_DEVICES for a worker Ray assigned the GPU(s) ``assigned`` (``ray.get_gpu_ids()``: ids among the
    raylet's ``inherited`` CUDA_VISIBLE_DEVICES when it had one, else indices below ``node_gpus``): the first of them,
    then the node's other GPUs."""
    from services.handoff.cuda_ipc import gpu_order

    visible = [d.strip() for d in (inherited or "").split(",") if d.strip()] or [str(i) for i in range(node_gpus)]
    if not assigned:
        raise RuntimeError("Ray assigned this GPU worker no GPU")
    own = str(assigned[0])
    if own not in visible:
        raise RuntimeError(f"Ray assigned GPU {own}, which is not among the node's GPUs {visible}")
    return gpu_order(own, visible)


def _see_node_gpus(name: str) -> None:
    """On Ray, before anything touches CUDA: this GPU worker's CUDA_VISIBLE_DEVICES, its own GPU first
    (``node_gpu_order``)."""
    ray = sys.modules.get("ray")
    if (ray is None or not ray.is_initialized() or os.environ.get(next(iter(NODE_GPUS_ENV))) != "1"
            or ray.get_runtime_context().get_actor_id() is None):       # not a Ray actor (a driver, a local child)
        return
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError(f"{name}: CUDA was initialised before the worker chose its GPUs")
    node = ray.get_runtime_context().get_node_id()
    count = next((int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n["NodeID"] == node), 0)
    order = node_gpu_order(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"), count)
    os.environ["CUDA_VISIBLE_DEVICES"] = order
    logging.getLogger(__name__).info("%s sees GPUs %s (its own first)", name, order)


async def _create(spec: ServiceSpec, port: int):
    if spec.role == "store":
        from services.kvstore import create_server

        return await create_server(spec.store, host=spec.host, port=port, metrics_port=0, tls=spec.cluster_tls)
    if spec.role == "prefill":
        from services.prefill.server import create_server

        return await create_server(spec.name, spec.engine, list(spec.store_addresses), spec.prefill,
                                   host=spec.host, port=port, on_fatal=_exit_for_restart, cluster_tls=spec.cluster_tls)
    if spec.role == "decode":
        from services.decode.server import create_server

        return await create_server(spec.name, spec.engine, list(spec.store_addresses), spec.decode,
                                   host=spec.host, port=port, on_fatal=_exit_for_restart, cluster_tls=spec.cluster_tls,
                                   index_address=spec.index_address)
    if spec.role == "index":
        # NOTE: faiss (the build's exact kNN) sizes its OpenMP pool from this when it loads; Ray sets it to the actor's
        # CPUs (none asked: 1). The service's cores are its threads
        os.environ["OMP_NUM_THREADS"] = str(spec.index_threads)
        from services.index.server import create_server

        return await create_server(threads=spec.index_threads, host=spec.host, port=port, metrics_port=0,
                                   tls=spec.cluster_tls, host_dtype=spec.index_host_dtype)
    if spec.role == "gateway":
        from services.cluster.serving import RayKV
        from services.gateway.inputs import ChunkRegistry
        from services.gateway.server import create_server

        # registered chunk ids outlive a gateway restart in Ray's internal KV
        registry = ChunkRegistry(RayKV(f"tessera/chunks/{spec.namespace}/"))
        return await create_server(spec.model_dir, list(spec.workers), token=spec.token, tls=spec.tls, host=spec.host,
                                   tenants=gateway_tenants(spec),
                                   port=port, resolve=_resolver(spec.namespace), registry=registry,
                                   text_cache_tokens=spec.text_cache_tokens, cluster_tls=spec.cluster_tls,
                                   routing=spec.routing)
    raise ValueError(f"unknown role {spec.role!r}")


class RestartLimitExceeded(RuntimeError):
    """A crashed actor was restarted too often lately: it does not start again."""


@dataclass(frozen=True, slots=True)
class RestartBudget:
    """How often a crashed actor may come back: ``max_restarts`` times within any ``window_s`` seconds
    (-1: no limit), so that a worker crashing now and then is always restarted and a crash loop ends."""

    max_restarts: int
    window_s: float

    def record(self, history: Sequence[float], now: float) -> list[float]:
        """The restart times (seconds since the epoch) within the window once one at ``now`` is added;
        raises RestartLimitExceeded when they are more than ``max_restarts``."""
        recent = [t for t in history if now - t < self.window_s] + [now]
        if 0 <= self.max_restarts < len(recent):
            raise RestartLimitExceeded(
                f"restarted {len(recent)} times within {self.window_s:g} s, more than the {self.max_restarts} "
                "allowed (tessera up --max-restarts N --restart-window-s W): not starting again")
        return recent


def _count_restart(spec: ServiceSpec, budget: RestartBudget) -> None:
    """On Ray: note a restart of this actor in Ray's internal KV (it outlives the process), or refuse it."""
    import ray

    kv = RayKV(f"tessera/restarts/{spec.namespace}/")
    if not ray.get_runtime_context().was_current_actor_reconstructed:
        kv.put(spec.name, b"[]")           # a new actor: restarts of an earlier one with this name don't count
        return
    raw = kv.get(spec.name)
    try:
        recent = budget.record(json.loads(raw) if raw else [], time.time())
    except RestartLimitExceeded as exc:
        refused = RestartLimitExceeded(f"{spec.name} {exc}")
        logging.getLogger(__name__).critical("%s", refused)
        raise refused from None
    kv.put(spec.name, json.dumps(recent).encode())


class ServiceActor:
    def __init__(self, spec: ServiceSpec, restarts: RestartBudget | None = None) -> None:
        """``restarts``: the cluster's restart budget, on Ray (None: no count, as in a local child process)."""
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {spec.name} %(levelname)s %(message)s")
        if restarts is not None:
            _count_restart(spec, restarts)
        if spec.role in ("prefill", "decode"):
            _see_node_gpus(spec.name)
        self.spec = spec
        self._loop = LoopThread(f"{spec.role}-loop")
        key = f"{spec.namespace}/{spec.name}"
        port = remembered_port(key, spec.host, spec.port)
        self._server, self._port = self._loop.run(_create(spec, port), timeout=900)
        remember_port(key, self._port)
        self._address = f"{advertised_host(spec.host)}:{self._port}"

    def address(self) -> str:
        return self._address

    def metrics_url(self) -> str:
        """Where this actor serves /metrics (Prometheus text)."""
        if self.spec.role in ("store", "index"):
            return f"http://{advertised_host(self.spec.host)}:{self._server.metrics_port}/metrics"
        return self._server.servicer.metrics_url

    def ping(self) -> str:
        return "ok"

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str | None:
        """The Ray node this actor runs on (None outside Ray: a local child process)."""
        ray = sys.modules.get("ray")
        return ray.get_runtime_context().get_node_id() if ray is not None and ray.is_initialized() else None

    def stop(self) -> None:
        self._loop.run(self._server.stop(1.0), timeout=30)
        self._loop.stop()
