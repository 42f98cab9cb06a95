"""What a launcher starts, decided before anything starts: one ``Plan`` for both launchers.

``on_ray.start_cluster`` (Ray actors) and ``local.start_local_cluster`` (child processes) start the same
services in the same order from a ``Plan``: the store shards and the retrieval index services (workers need
their addresses; one index service per decode worker, ``tessera-index-<i>`` beside ``tessera-decode-<i>``, on
its node, unless ``index_threads`` is 0), then the prefill and decode workers (each loads the model), then the
gateway (it needs the workers' addresses). A launcher adds only how a service is started, where it runs, where
its GPUs come from and how it is stopped.

Invariant: a bad tenants file is refused before anything exists (no certificates minted, no directory made),
and whatever the plan made (temporary RocksDB, shared-memory and certificate directories) is removed by ``remove_scratch``
when the cluster stops or fails to start.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass

from services.cluster.config import ClusterConfig
from services.cluster.security import ClusterTLS, identities
from services.launch.actors import ServiceSpec

GATEWAY_NAME = "tessera-gateway"
WORKER_ROLES = ("prefill", "decode")


def checked_tenants(cfg: ClusterConfig) -> dict | None:
    """The cluster's tenants file (ClusterConfig.tenants_file) read and checked before anything starts: a bad
    file is a ValueError naming it, from ``tessera up`` and both launchers. Returns its mapping, or None."""
    if cfg.tenants_file is None:
        return None
    from services.gateway.tenants import Tenants

    return Tenants.load(cfg.tenants_file)[1]


STOP_RANKS = {"gateway": 0, "prefill": 1, "decode": 1, "index": 2, "store": 3}


def stop_order(names: Iterable[str]) -> list[str]:
    """The gateway first (no new requests), then the workers, then the index services (the decode workers drop
    what they offloaded), then the stores (what they write lands)."""
    return sorted(names, key=lambda n: (STOP_RANKS.get(role_of(n), 1), n))


def role_of(name: str) -> str:
    """The role a service's name states: ``tessera-<role>[-<i>]``."""
    parts = name.split("-")
    return parts[1] if len(parts) > 1 else ""


SHM = "/dev/shm"       # the memory file system the store shards' DRAM tiers live in, where a machine has one


def remove_dirs(*paths: str | None) -> None:
    for path in paths:
        if path:
            shutil.rmtree(path, ignore_errors=True)


@dataclass(slots=True)
class Plan:
    """The services of one cluster and what they are handed.

    names: role -> service names, ``tessera-<role>-<i>`` ("store", "index", "prefill", "decode"; the gateway is
    GATEWAY_NAME); index service i serves decode worker i. tenants: the tenants file's mapping, for the gateway.
    ids: each role's mutual-TLS identity (None: plain internal traffic). scratch: the temporary RocksDB directory
    made when ``cfg.store_dir`` was None (then ``cfg.store_dir`` names it); certs_scratch: the development CA minted
    when ``cfg.certs_dir`` was None; shm_scratch: the directory in /dev/shm holding the store shards' DRAM tiers
    (``tiers.ShmDramTier``: workers on their host read chunks from them) when ``cfg.store_shm`` and this machine has
    one, else None (the tiers in the shards' own memory).
    """

    cfg: ClusterConfig
    names: dict[str, list[str]]
    tenants: dict | None
    ids: dict[str, ClusterTLS] | None
    scratch: str | None
    certs_scratch: str | None
    shm_scratch: str | None = None

    @classmethod
    def make(cls, cfg: ClusterConfig) -> Plan:
        tenants = checked_tenants(cfg)      # before anything starts: a bad file starts nothing
        ids, certs_scratch = identities(cfg.certs_dir, cfg.internal_tls)
        scratch = shm = None
        try:
            if cfg.store_dir is None and cfg.stores:
                scratch = cfg.store_dir = tempfile.mkdtemp(prefix="tessera-rocksdb-")
            if cfg.store_dir is not None:
                os.makedirs(cfg.store_dir, exist_ok=True)
            if cfg.store_shm and cfg.stores and os.path.isdir(SHM) and os.access(SHM, os.W_OK):
                shm = tempfile.mkdtemp(prefix="tessera-dram-", dir=SHM)
        except BaseException:
            remove_dirs(scratch, certs_scratch, shm)
            raise
        names = {"store": [f"tessera-store-{i}" for i in range(cfg.stores)],
                 "prefill": [f"tessera-prefill-{i}" for i in range(cfg.prefill)],
                 "decode": [f"tessera-decode-{i}" for i in range(cfg.decode)],
                 "index": [f"tessera-index-{i}" for i in range(cfg.decode if cfg.index_threads else 0)]}
        return cls(cfg, names, tenants, ids, scratch, certs_scratch, shm)

    @property
    def workers(self) -> list[str]:
        """The prefill workers' names, then the decode workers'."""
        return self.names["prefill"] + self.names["decode"]

    def role(self, name: str) -> str:
        return next(r for r, names in self.names.items() if name in names)

    def tls(self, role: str) -> ClusterTLS | None:
        return None if self.ids is None else self.ids.get(role)

    def index_of(self, decode: str) -> str | None:
        """The name of a decode worker's index service (None: the cluster runs none)."""
        i = self.names["decode"].index(decode)
        return self.names["index"][i] if self.names["index"] else None

    def store_specs(self) -> list[ServiceSpec]:
        cfg = self.cfg
        from services.kvstore import StoreConfig

        return [ServiceSpec("store", name, host=cfg.bind_host, namespace=cfg.namespace, cluster_tls=self.tls("store"),
                            store=StoreConfig(dram_bytes=cfg.store_dram_bytes, write_mode="behind",
                                              rocksdb_dir=os.path.join(cfg.store_dir, name),
                                              dram_dir=os.path.join(self.shm_scratch, name) if self.shm_scratch else None,
                                              # workers on other hosts read its arena over NIXL when the cluster's
                                              # data plane is NIXL
                                              nixl=bool(self.shm_scratch)
                                              and cfg.prefill_settings.handoff_transport == "nixl"))
                for name in self.names["store"]]

    def index_specs(self) -> list[ServiceSpec]:
        """The index services' specs: CPU only, each with the cluster's "index" identity."""
        cfg = self.cfg
        return [ServiceSpec("index", name, host=cfg.bind_host, namespace=cfg.namespace, cluster_tls=self.tls("index"),
                            index_threads=cfg.index_threads, index_host_dtype=cfg.index_host_dtype)
                for name in self.names["index"]]

    def worker_spec(self, name: str, stores: tuple[str, ...], addresses: dict[str, str] | None = None) -> ServiceSpec:
        """A prefill or decode worker's spec; ``stores``: the store shards' addresses; ``addresses``: service name ->
        address, a decode worker's index service's among them when the cluster runs index services."""
        cfg, role = self.cfg, self.role(name)
        index = self.index_of(name) if role == "decode" else None
        if index is not None and (addresses is None or index not in addresses):
            raise ValueError(f"{name} needs the address of its index service {index}: start it first")
        return ServiceSpec(role, name, host=cfg.bind_host, engine=cfg.engine(), store_addresses=stores,
                           prefill=cfg.prefill_settings if role == "prefill" else None,
                           decode=cfg.decode_settings if role == "decode" else None,
                           namespace=cfg.namespace, cluster_tls=self.tls(role),
                           index_address=None if index is None else addresses[index])

    def gateway_spec(self, addresses: dict[str, str]) -> ServiceSpec:
        """The gateway's spec; ``addresses``: service name -> address, every worker's among them."""
        cfg = self.cfg
        workers = tuple((n, self.role(n), addresses[n]) for n in self.workers)
        return ServiceSpec("gateway", GATEWAY_NAME, host=cfg.bind_host, port=cfg.gateway_port,
                           model_dir=cfg.model_dir, workers=workers, token=cfg.token, tenants=self.tenants,
                           tls=cfg.tls(), namespace=cfg.namespace, text_cache_tokens=cfg.text_cache_tokens,
                           cluster_tls=self.tls("gateway"), routing=cfg.routing)

    def remove_scratch(self) -> None:
        remove_dirs(self.scratch, self.certs_scratch, self.shm_scratch)
