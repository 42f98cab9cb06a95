"""The cluster without Ray: one child process per service on this machine.

Where Ray cannot be installed (a bare GPU machine), ``start_local_cluster(cfg)`` starts the same
services ``start_cluster`` places on Ray (store shards, retrieval index services, prefill and decode
workers, the gateway),
each in its own spawned process, as a Ray actor would be, so that no two services share an
interpreter lock. A child builds its service with the actor code (``ServiceActor``; outside Ray
port memory is off) and reports its address over a pipe; the gateway keeps registered chunk ids in
its own memory and is handed fixed worker addresses. No restarts: a child that dies stays dead.
GPUs are placed as ``start_cluster`` places them on Ray: with at least one GPU per worker each worker process
has its own (first in its ``CUDA_VISIBLE_DEVICES``; the host's others follow, for hand-offs GPU to GPU), else they
take the GPUs round-robin and share them. ``tessera up`` keeps
using Ray; this is for benchmarks and tests.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import Connection
import os
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

from services.cluster.config import ClusterConfig
from services.launch.actors import ServiceSpec, gateway_tenants
from services.launch.plan import GATEWAY_NAME, Plan, remove_dirs, stop_order

START_TIMEOUT_S = 900.0      # loading an 8B model from disk and warming it up


class _Gateway:
    """The gateway's service in a child, with ServiceActor's methods (address, metrics_url, stop)."""

    def __init__(self, spec: ServiceSpec) -> None:
        from services.cluster.serving import LoopThread, advertised_host
        from services.gateway.inputs import ChunkRegistry
        from services.gateway.server import create_server

        self._loop = LoopThread("gateway-loop")
        # resolve=None: no worker comes back at another address (there are no restarts here)
        self._server, port = self._loop.run(
            create_server(spec.model_dir, list(spec.workers), token=spec.token, tls=spec.tls, host=spec.host,
                          tenants=gateway_tenants(spec),
                          port=spec.port, registry=ChunkRegistry(), resolve=None,
                          text_cache_tokens=spec.text_cache_tokens, cluster_tls=spec.cluster_tls, routing=spec.routing),
            timeout=START_TIMEOUT_S)
        self._address = f"{advertised_host(spec.host)}:{port}"

    def address(self) -> str:
        return self._address

    def metrics_url(self) -> str:
        return self._server.servicer.metrics_url

    def stop(self) -> None:
        self._loop.run(self._server.stop(1.0), timeout=30)
        self._loop.stop()


def _serve(spec: ServiceSpec, conn: Connection) -> None:
    """Child process: start the service, send ("ok", address, metrics URL) or ("error", text), then
    serve until the parent sends "stop" or goes away (the pipe closes)."""
    import logging

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {spec.name} %(levelname)s %(message)s")
    try:
        if spec.role == "gateway":
            service = _Gateway(spec)
        else:
            from services.launch.actors import ServiceActor

            service = ServiceActor(spec)
        conn.send(("ok", service.address(), service.metrics_url()))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", traceback.format_exc()))
        return
    try:
        conn.recv()
    except EOFError:
        pass
    service.stop()


@dataclass(slots=True)
class _Child:
    process: mp.process.BaseProcess
    conn: Connection


@dataclass(slots=True)
class LocalCluster:
    """A started local cluster; the fields ``bench/cluster/cluster.py`` and the CLI read from ``Cluster``."""

    config: ClusterConfig
    gateway_address: str
    addresses: dict[str, str]
    children: dict[str, _Child]
    scratch: str | None = None
    names: dict[str, list[str]] = field(default_factory=dict)
    metrics: dict[str, str] = field(default_factory=dict)
    certs_scratch: str | None = None    # the development CA minted for this cluster, removed by stop()
    shm_scratch: str | None = None      # the store shards' shared-memory DRAM tiers, removed by stop()

    def stop(self) -> None:
        _stop_children(self.children)
        remove_dirs(self.scratch, self.certs_scratch, self.shm_scratch)


def _stop_children(children: dict[str, _Child]) -> None:
    """In ``plan.stop_order``, as ``stop_cluster`` does."""
    for name in stop_order(children):
        child = children[name]
        try:
            child.conn.send("stop")
        except (BrokenPipeError, OSError):
            pass
        child.process.join(30)
        if child.process.is_alive():
            child.process.kill()
            child.process.join(5)
        child.conn.close()


def worker_gpus(n_workers: int, visible: list[str]) -> list[str | None]:
    """The GPUs each of ``n_workers`` worker processes sees (its CUDA_VISIBLE_DEVICES), from the machine's
    ``visible`` ones: its own first (one each, round-robin, so shared, when there are fewer than workers), then the
    others, whose hand-off buffers it copies GPU to GPU (``cuda_ipc.gpu_order``); None (the environment as it is)
    with one GPU or none."""
    from services.handoff.cuda_ipc import gpu_order

    if len(visible) <= 1:
        return [None] * n_workers
    return [gpu_order(visible[k % len(visible)], visible) for k in range(n_workers)]


def visible_gpus() -> list[str]:
    """This process's GPUs as CUDA_VISIBLE_DEVICES names them."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    named = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return named[:n] if named else [str(i) for i in range(n)]


@contextmanager
def child_gpus(gpus: str | None):
    """CUDA_VISIBLE_DEVICES = ``gpus`` for the processes started inside the block (a spawned child takes this process's
    environment as it is at start()), this process's own again after it; None: the environment as it is."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus
    try:
        yield
    finally:
        if gpus is not None and before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        elif gpus is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def _spawn(ctx, spec: ServiceSpec, children: dict[str, _Child], gpus: str | None = None) -> None:
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_serve, args=(spec, child), name=spec.name, daemon=True)
    with child_gpus(gpus):
        process.start()
    child.close()
    children[spec.name] = _Child(process, parent)


def _wait(children: dict[str, _Child], names: list[str], addresses: dict[str, str], metrics: dict[str, str]) -> None:
    for name in names:
        child = children[name]
        if not child.conn.poll(START_TIMEOUT_S):
            raise TimeoutError(f"{name} did not start within {START_TIMEOUT_S:.0f} s")
        try:
            reply = child.conn.recv()
        except EOFError:
            raise RuntimeError(f"{name} exited while starting (exit code {child.process.exitcode})") from None
        if reply[0] != "ok":
            raise RuntimeError(f"{name} failed to start:\n{reply[1]}")
        addresses[name], metrics[name] = reply[1], reply[2]


def start_local_cluster(cfg: ClusterConfig, progress: Callable[[str], None] = lambda _m: None) -> LocalCluster:
    """Start every service as a child process of this one, in the plan's order, and wait until each serves."""
    ctx = mp.get_context("spawn")       # CUDA cannot be used in a forked child
    children: dict[str, _Child] = {}
    addresses: dict[str, str] = {}
    metrics: dict[str, str] = {}
    plan = Plan.make(cfg)
    try:
        progress(f"starting {cfg.stores} KV store shard(s) and {len(plan.names['index'])} retrieval index "
                 "service(s) (local processes)")
        for spec in plan.store_specs() + plan.index_specs():       # CPU only: no CUDA_VISIBLE_DEVICES of their own
            _spawn(ctx, spec, children)
        _wait(children, plan.names["store"] + plan.names["index"], addresses, metrics)
        stores = tuple(addresses[n] for n in plan.names["store"])
        gpus = worker_gpus(len(plan.workers), visible_gpus() if cfg.device == "cuda" else [])
        where = f" (GPUs {', '.join(g.split(',')[0] for g in gpus)})" if gpus and gpus[0] is not None else ""
        progress(f"starting {cfg.prefill} prefill and {cfg.decode} decode worker(s) on {cfg.device}{where}")
        for name, gpu in zip(plan.workers, gpus):
            _spawn(ctx, plan.worker_spec(name, stores, addresses), children, gpu)
        _wait(children, plan.workers, addresses, metrics)
        progress("starting the gateway")
        _spawn(ctx, plan.gateway_spec(addresses), children)
        _wait(children, [GATEWAY_NAME], addresses, metrics)
    except BaseException:
        _stop_children(children)
        plan.remove_scratch()
        raise
    return LocalCluster(cfg, addresses[GATEWAY_NAME], addresses, children, plan.scratch, plan.names, metrics,
                        plan.certs_scratch, plan.shm_scratch)


__all__ = ["LocalCluster", "start_local_cluster"]
