"""Placing the cluster on Ray: store shards, then prefill and decode workers, then the gateway.

Actors are named ``tessera-<role>-<i>`` in the config's namespace, so ``tessera down`` (another
process) finds them, and are restarted by Ray up to ``max_restarts`` times. Workers ask Ray for a
CPU each and, when they run on CUDA, a GPU each; store shards and the gateway mostly wait on the
network and ask for none. With no Ray address a local instance is started (small object store:
Tessera moves KV over gRPC, not through Ray's object store).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

from services.cluster.actors import ServiceActor, ServiceSpec
from services.cluster.config import ClusterConfig, DecodeSettings, PrefillSettings
from services.cluster.security import identities

GATEWAY_NAME = "tessera-gateway"
OBJECT_STORE_BYTES = 96 << 20


def _ray():
    import ray

    return ray


def ensure_ray(address: str | None = None, num_cpus: int | None = None, namespace: str = "tessera") -> bool:
    """Connect to Ray at ``address`` (or "auto"), else start a local instance; True if started here."""
    ray = _ray()
    if ray.is_initialized():
        return False
    quiet = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
    if address:
        ray.init(address=address, namespace=namespace, log_to_driver=False)
        return False
    ray.init(num_cpus=num_cpus, object_store_memory=OBJECT_STORE_BYTES, namespace=namespace, **quiet)
    return True


@dataclass(slots=True)
class Cluster:
    """A started cluster: its gateway address, actor handles by name, and each service's address."""

    config: ClusterConfig
    gateway_address: str
    actors: dict[str, object]
    addresses: dict[str, str]
    scratch: str | None = None          # temporary RocksDB directories, removed by stop()
    names: dict[str, list[str]] = field(default_factory=dict)
    metrics: dict[str, str] = field(default_factory=dict)     # actor name -> its /metrics URL
    certs_scratch: str | None = None    # the development CA minted for this cluster, removed by stop()

    def handle(self, name: str):
        return self.actors[name]

    def stop(self) -> None:
        stop_cluster(self.config.namespace, self.actors)
        for path in (self.scratch, self.certs_scratch):
            if path:
                shutil.rmtree(path, ignore_errors=True)


HEAD_RESOURCE = "node:__internal_head__"  # the custom resource Ray gives its head node (one unit)


def actor_options(cfg: ClusterConfig, name: str, num_cpus: float, num_gpus: float) -> dict:
    """Ray actor options for one service. With ``cfg.gateway_on_head`` the gateway asks for a sliver of the
    head node's own resource, so it runs there: a Kubernetes Service in front of the head pod reaches it
    (helm/tessera)."""
    opts = dict(name=name, namespace=cfg.namespace, max_restarts=cfg.max_restarts, max_task_retries=0,
                num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=4)
    if cfg.detached:
        opts["lifetime"] = "detached"
    if cfg.gateway_on_head and name == GATEWAY_NAME:
        opts["resources"] = {HEAD_RESOURCE: 0.01}
    return opts


def _remote(cfg: ClusterConfig, name: str, num_cpus: float, num_gpus: float):
    return _ray().remote(ServiceActor).options(**actor_options(cfg, name, num_cpus, num_gpus))


def _gpus_per_worker(cfg: ClusterConfig) -> float:
    """One GPU per worker when the cluster has enough, else an equal share (workers then share GPUs)."""
    if not cfg.device.startswith("cuda"):
        return 0
    total = _ray().cluster_resources().get("GPU", 0)
    if total <= 0:
        raise ValueError("--device cuda, but the Ray cluster has no GPU")
    workers = cfg.prefill + cfg.decode
    return 1 if total >= workers else total / workers


def start_cluster(cfg: ClusterConfig, progress: Callable[[str], None] = lambda _m: None) -> Cluster:
    """Start every actor and wait until each serves; Ray must be initialised."""
    from services.kvstore import StoreConfig

    ray = _ray()
    from services.cluster.serving import forget_ports

    forget_ports(f"tessera/port/{cfg.namespace}/")
    forget_ports(f"tessera/chunks/{cfg.namespace}/")     # ids registered with an earlier cluster
    actors: dict[str, object] = {}
    addresses: dict[str, str] = {}
    scratch = None
    ids, certs_scratch = identities(cfg.certs_dir, cfg.internal_tls)
    tls = ids.get if ids is not None else (lambda _role: None)
    if cfg.store_dir is None and cfg.stores:
        scratch = cfg.store_dir = tempfile.mkdtemp(prefix="tessera-rocksdb-")
    if cfg.store_dir is not None:
        os.makedirs(cfg.store_dir, exist_ok=True)
    try:
        names = {"store": [f"tessera-store-{i}" for i in range(cfg.stores)],
                 "prefill": [f"tessera-prefill-{i}" for i in range(cfg.prefill)],
                 "decode": [f"tessera-decode-{i}" for i in range(cfg.decode)]}
        progress(f"starting {cfg.stores} KV store shard(s)")
        for name in names["store"]:
            store = StoreConfig(dram_bytes=cfg.store_dram_bytes, rocksdb_dir=os.path.join(cfg.store_dir, name),
                                write_mode="behind")
            spec = ServiceSpec("store", name, host=cfg.bind_host, store=store, namespace=cfg.namespace,
                               cluster_tls=tls("store"))
            actors[name] = _remote(cfg, name, 0, 0).remote(spec)
        addresses.update(zip(names["store"], ray.get([actors[n].address.remote() for n in names["store"]])))
        stores = tuple(addresses[n] for n in names["store"])
        gpus = _gpus_per_worker(cfg)
        progress(f"starting {cfg.prefill} prefill and {cfg.decode} decode worker(s) on {cfg.device}")
        for role in ("prefill", "decode"):
            for name in names[role]:
                spec = ServiceSpec(role, name, host=cfg.bind_host, engine=cfg.engine(), store_addresses=stores,
                                   prefill=cfg.prefill_settings if role == "prefill" else None,
                                   decode=cfg.decode_settings if role == "decode" else None, namespace=cfg.namespace,
                                   cluster_tls=tls(role))
                actors[name] = _remote(cfg, name, 1, gpus).remote(spec)
        workers = names["prefill"] + names["decode"]
        addresses.update(zip(workers, ray.get([actors[n].address.remote() for n in workers])))
        progress("starting the gateway")
        spec = ServiceSpec("gateway", GATEWAY_NAME, host=cfg.bind_host, port=cfg.gateway_port, model_dir=cfg.model_dir,
                           workers=tuple((n, "prefill" if "prefill" in n else "decode", addresses[n]) for n in workers),
                           token=cfg.token, tenants=cfg.tenants(), tls=cfg.tls(), namespace=cfg.namespace,
                           text_cache_tokens=cfg.text_cache_tokens, cluster_tls=tls("gateway"))
        actors[GATEWAY_NAME] = _remote(cfg, GATEWAY_NAME, 0, 0).remote(spec)
        addresses[GATEWAY_NAME] = ray.get(actors[GATEWAY_NAME].address.remote())
        metrics = dict(zip(actors, ray.get([a.metrics_url.remote() for a in actors.values()])))
    except BaseException:
        stop_cluster(cfg.namespace, actors)
        for path in (scratch, certs_scratch):
            if path:
                shutil.rmtree(path, ignore_errors=True)
        raise
    return Cluster(cfg, addresses[GATEWAY_NAME], actors, addresses, scratch, names, metrics, certs_scratch)


def find_actors(namespace: str = "tessera") -> dict[str, object]:
    """The named Tessera actors alive in ``namespace`` (for ``tessera down``)."""
    ray = _ray()
    from ray.util import list_named_actors

    found = {}
    for entry in list_named_actors(all_namespaces=True):
        if entry["namespace"] == namespace and entry["name"].startswith("tessera-"):
            found[entry["name"]] = ray.get_actor(entry["name"], namespace=namespace)
    return found


def stop_cluster(namespace: str = "tessera", actors: dict[str, object] | None = None) -> list[str]:
    """Stop the gateway first (no new requests), then workers, then stores; returns the names stopped."""
    ray = _ray()
    actors = find_actors(namespace) if actors is None else actors
    order = sorted(actors, key=lambda n: (0 if "gateway" in n else 1 if "store" not in n else 2, n))
    for name in order:
        try:
            ray.get(actors[name].stop.remote(), timeout=20)
        except Exception:  # noqa: BLE001 - a dead or stuck actor is killed below anyway
            pass
        ray.kill(actors[name], no_restart=True)
    return order


__all__ = ["Cluster", "ClusterConfig", "PrefillSettings", "DecodeSettings", "ensure_ray", "start_cluster",
           "stop_cluster", "find_actors"]
