"""Placing the cluster on Ray: store shards and retrieval index services, then prefill and decode workers,
then the gateway.

Actors are named ``tessera-<role>-<i>`` in the config's namespace, so ``tessera down`` (another
process) finds them. Ray restarts a crashed actor every time; the actor itself refuses to start
again once it has been restarted more than ``max_restarts`` times within ``restart_window_s``
(``actors.RestartBudget``). Workers ask Ray for a CPU each and, when they run on CUDA, a GPU each;
store shards and the gateway mostly wait on the network and ask for none. Each decode worker and its
index service share a placement group, so one node (``placement.py``; the index service asks for no
CPU of Ray's: its threads are the node's). With no Ray address
``ensure_ray`` starts Ray in this process (small object store: Tessera moves KV over gRPC, not
through Ray's object store); ``tessera up`` starts a head of the cluster's own instead
(``start_local_head``: loopback only, token authentication, its own temp dir), and ``tessera down``
stops that head's processes only (``stop_local_head``).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from services.cluster.config import ClusterConfig, DecodeSettings, PrefillSettings
from services.launch.actors import NODE_GPUS_ENV, RestartBudget, ServiceActor, ServiceSpec
from services.launch.placement import in_group, make_group, remove_groups
from services.launch.plan import GATEWAY_NAME, Plan, remove_dirs, stop_order

if TYPE_CHECKING:
    from ray.actor import ActorHandle

OBJECT_STORE_BYTES = 96 << 20


def _ray():
    import ray

    return ray


def ensure_ray(address: str | None = None, num_cpus: int | None = None, namespace: str = "tessera") -> bool:
    """Connect to Ray at ``address`` (or "auto"), else start a local instance in this process (``tessera demo``,
    benchmarks, tests); True if started here. A local instance is made as safe as ``tessera up``'s head: on
    loopback only when Ray is imported here first (see LOOPBACK_ENV), with token authentication whose token is
    a file of this user's alone (Ray's default, ~/.ray/auth_token, is written readable by everyone)."""
    imported = "ray" in sys.modules
    if imported and _ray().is_initialized():
        return False
    quiet = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
    if address:
        _ray().init(address=address, namespace=namespace, log_to_driver=False)
        return False
    if not imported:
        os.environ.setdefault(LOOPBACK_ENV, "0")
    if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
        os.environ["RAY_AUTH_TOKEN_PATH"] = _private_token()
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        if imported:    # Ray read its settings when imported: have it read them again, as it does itself
            from ray._raylet import Config

            Config.initialize("")
    ray = _ray()
    from ray._private import ray_constants

    loopback = {} if ray_constants.ENABLE_RAY_CLUSTER else {"_node_ip_address": "127.0.0.1"}
    ray.init(num_cpus=num_cpus, object_store_memory=OBJECT_STORE_BYTES, namespace=namespace, **quiet, **loopback)
    return True


@contextmanager
def local_cluster(cfg: ClusterConfig, progress: Callable[[str], None] = lambda _m: None):
    """A cluster on a Ray instance started in this process when none is running (``tessera demo`` and ``tessera
    chaos``): yields the started ``Cluster``, then stops it and that Ray instance."""
    progress("starting a local Ray instance")
    started = ensure_ray(num_cpus=cfg.prefill + cfg.decode + 1)
    cluster = None
    try:
        cluster = start_cluster(cfg, progress=progress)
        yield cluster
    finally:
        if cluster is not None:
            progress("stopping the cluster")
            cluster.stop()
        if started:
            _ray().shutdown()


def _private_token() -> str:
    """A new Ray token in a 0700 directory of this process's, removed when it exits."""
    import atexit

    root = Path(tempfile.mkdtemp(prefix="tessera-ray-token-"))      # mode 0700
    atexit.register(shutil.rmtree, root, True)
    return _write_token(root)


# NOTE: Ray replaces --node-ip-address=127.0.0.1 with the machine's routable address, and a driver's
# 127.0.0.1:PORT likewise, unless this is 0 (its switch for one-machine clusters on macOS and Windows).
# With the node IP on loopback, the GCS, raylet, agents and workers listen on 127.0.0.1 only, and no
# other machine can join. Ray reads it once, when imported.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# NOTE: Ray's Unix sockets live under <temp dir>/session_<date>_<pid>/sockets/ and a socket path holds
# ~107 bytes at most: the temp dir stays short (/tmp/tessera-ray-XXXXXXXX/ray) whatever TMPDIR says
HEAD_TEMP_ROOT = "/tmp" if os.path.isdir("/tmp") else None


@dataclass(frozen=True, slots=True)
class LocalHead:
    """A Ray head that ``tessera up`` started for one cluster, on this machine (recorded in its state file).

    address: the GCS, ``127.0.0.1:PORT``: never "auto", which finds whatever Ray runs on the machine.
    temp_dir: a directory of mode 0700 that holds Ray's ``--temp-dir`` (``<temp_dir>/ray``: sessions, logs,
    sockets; Ray makes it readable and writable by all). Each process of this head names it or the GCS
    address on its command line, or descends from one that does.
    token_path: Ray's authentication token (mode 0600, alone in a 0700 directory); a caller without it
    is refused.
    """

    address: str
    temp_dir: str
    token_path: str

    def env(self) -> dict[str, str]:
        """What a process needs in its environment, before it imports ray, to reach this head."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": self.token_path, LOOPBACK_ENV: "0"}


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on loopback now (held together while picked, so never the same twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _write_token(token_root: Path) -> str:
    token_root.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="ray-token-", dir=token_root)) / "token"    # mkdtemp: mode 0700
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32))
    return str(path)


def start_local_head(num_cpus: int, token_root: str | Path, ray_cli: str = "ray") -> LocalHead:
    """Start a Ray head of its own for one cluster: listening on loopback only, token authentication on
    (a new token, in a directory of its own under ``token_root``), its own temp dir and ports."""
    gcs_port, client_port = _free_ports(2)
    head = LocalHead(f"127.0.0.1:{gcs_port}", tempfile.mkdtemp(prefix="tessera-ray-", dir=HEAD_TEMP_ROOT),
                     _write_token(Path(token_root)))
    cmd = [ray_cli, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs_port}",
           f"--ray-client-server-port={client_port}", f"--temp-dir={head.temp_dir}/ray", f"--num-cpus={num_cpus}",
           "--include-dashboard=false", f"--object-store-memory={OBJECT_STORE_BYTES}", "--disable-usage-stats"]
    try:
        subprocess.run(cmd, check=True, env={**os.environ, **head.env()}, stdout=subprocess.DEVNULL)
    except BaseException:
        stop_local_head(head)
        raise
    return head


def use_local_head(head: LocalHead) -> None:
    """Set this process's environment so that ``ray.init(address=head.address)`` reaches ``head``."""
    consts = sys.modules.get("ray._private.ray_constants")
    if consts is not None and consts.ENABLE_RAY_CLUSTER:
        raise RuntimeError(f"ray was imported before {LOOPBACK_ENV}=0 was set: it would look for the local head "
                           "on this machine's routable address, where nothing listens")
    os.environ.update(head.env())


def head_processes(head: LocalHead) -> list:
    """This head's processes (``psutil.Process``, this user's only): those whose command line names its temp
    dir or its GCS address, and their descendants (Ray workers rename themselves ``ray::...``)."""
    import psutil

    names_it = re.compile(rf"{re.escape(head.temp_dir)}(/|$)|(^|=){re.escape(head.address)}$")
    me = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    found = {}
    for proc in psutil.process_iter(["cmdline", "uids"]):
        uids = proc.info["uids"]
        if proc.pid in me or uids is None or uids.real != os.getuid():
            continue
        if any(names_it.search(arg) for arg in proc.info["cmdline"] or ()):
            found[proc.pid] = proc
    for proc in list(found.values()):
        try:
            found.update((child.pid, child) for child in proc.children(recursive=True) if child.pid not in me)
        except psutil.Error:
            pass
    return list(found.values())


def stop_local_head(head: LocalHead, grace_s: float = 10.0) -> int:
    """Stop ``head``'s processes, no other Ray's (``ray stop`` stops every Ray on the machine): SIGTERM,
    then SIGKILL for what is left after a bounded wait; raylet first and GCS last, in ``ray stop``'s
    order. Then remove its temp dir and token. Returns how many processes were stopped."""
    import psutil

    procs = head_processes(head)
    rank = {}
    for proc in procs:
        try:
            rank[proc.pid] = {"raylet": 0, "gcs_server": 2}.get(proc.name(), 1)
        except psutil.Error:
            rank[proc.pid] = 1
    for step in range(3):
        group = [p for p in procs if rank[p.pid] == step]
        for proc in group:
            try:
                proc.terminate()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(group, timeout=grace_s / 3)
        for proc in alive:
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=2)
    shutil.rmtree(head.temp_dir, ignore_errors=True)
    shutil.rmtree(Path(head.token_path).parent, ignore_errors=True)
    return len(procs)


@dataclass(slots=True)
class Cluster:
    """A started cluster: its gateway address, actor handles by name, and each service's address."""

    config: ClusterConfig
    gateway_address: str
    actors: dict[str, ActorHandle]
    addresses: dict[str, str]
    scratch: str | None = None          # temporary RocksDB directories, removed by stop()
    names: dict[str, list[str]] = field(default_factory=dict)
    metrics: dict[str, str] = field(default_factory=dict)     # actor name -> its /metrics URL
    certs_scratch: str | None = None    # the development CA minted for this cluster, removed by stop()
    shm_scratch: str | None = None      # the store shards' shared-memory DRAM tiers, removed by stop()

    def handle(self, name: str):
        return self.actors[name]

    def stop(self) -> None:
        stop_cluster(self.config.namespace, self.actors)
        remove_dirs(self.scratch, self.certs_scratch, self.shm_scratch)


HEAD_RESOURCE = "node:__internal_head__"  # the custom resource Ray gives its head node (one unit)


def actor_options(cfg: ClusterConfig, name: str, num_cpus: float, num_gpus: float, group=None) -> dict:
    """Ray actor options for one service. With ``cfg.gateway_on_head`` the gateway asks for a sliver of the
    head node's own resource, so it runs there: a Kubernetes Service in front of the head pod reaches it
    (helm/tessera). ``group``: the placement group it runs in (a decode worker's and its index service's)."""
    # NOTE: Ray restarts without limit; the restart rate is held by the actor (RestartBudget), since Ray's
    # own max_restarts counts over the actor's whole life
    opts = dict(name=name, namespace=cfg.namespace, max_restarts=-1, max_task_retries=0,
                num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=4)
    if cfg.detached:
        opts["lifetime"] = "detached"
    if cfg.gateway_on_head and name == GATEWAY_NAME:
        opts["resources"] = {HEAD_RESOURCE: 0.01}
    if group is not None:
        opts.update(in_group(group))
    if num_gpus > 0:                    # it sees its node's GPUs, its own first (actors.node_gpu_order)
        opts["runtime_env"] = {"env_vars": dict(NODE_GPUS_ENV)}
    return opts


def start_actor(cfg: ClusterConfig, spec: ServiceSpec, num_cpus: float, num_gpus: float, group=None):
    """The handle of a new ServiceActor serving ``spec``, under the cluster's restart budget."""
    actor = _ray().remote(ServiceActor).options(**actor_options(cfg, spec.name, num_cpus, num_gpus, group))
    return actor.remote(spec, RestartBudget(cfg.max_restarts, cfg.restart_window_s))


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
    ray = _ray()
    from services.cluster.serving import forget_ports

    forget_ports(f"tessera/port/{cfg.namespace}/")
    forget_ports(f"tessera/chunks/{cfg.namespace}/")     # ids registered with an earlier cluster
    actors: dict[str, ActorHandle] = {}
    addresses: dict[str, str] = {}
    plan = Plan.make(cfg)

    def started(names: list[str]) -> None:
        addresses.update(zip(names, ray.get([actors[n].address.remote() for n in names])))

    try:
        progress(f"starting {cfg.stores} KV store shard(s)")
        for spec in plan.store_specs():
            actors[spec.name] = start_actor(cfg, spec, 0, 0)
        started(plan.names["store"])
        stores = tuple(addresses[n] for n in plan.names["store"])
        gpus = _gpus_per_worker(cfg)
        groups = {}
        if plan.names["index"]:
            progress(f"starting {len(plan.names['index'])} retrieval index service(s), each on its decode worker's "
                     f"node ({cfg.index_threads} threads)")
            groups = {name: make_group(cfg, name, 1, gpus) for name in plan.names["decode"]}
            for spec, decode in zip(plan.index_specs(), plan.names["decode"]):
                actors[spec.name] = start_actor(cfg, spec, 0, 0, groups[decode])
            started(plan.names["index"])
        progress(f"starting {cfg.prefill} prefill and {cfg.decode} decode worker(s) on {cfg.device}")
        for name in plan.workers:
            actors[name] = start_actor(cfg, plan.worker_spec(name, stores, addresses), 1, gpus, groups.get(name))
        started(plan.workers)
        progress("starting the gateway")
        actors[GATEWAY_NAME] = start_actor(cfg, plan.gateway_spec(addresses), 0, 0)
        started([GATEWAY_NAME])
        metrics = dict(zip(actors, ray.get([a.metrics_url.remote() for a in actors.values()])))
    except BaseException:
        stop_cluster(cfg.namespace, actors)
        plan.remove_scratch()
        raise
    return Cluster(cfg, addresses[GATEWAY_NAME], actors, addresses, plan.scratch, plan.names, metrics,
                   plan.certs_scratch, plan.shm_scratch)


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
    """Stop the gateway first (no new requests), then workers, then index services, then stores, and remove the
    decode workers' placement groups; returns the names stopped."""
    ray = _ray()
    actors = find_actors(namespace) if actors is None else actors
    order = stop_order(actors)
    for name in order:
        try:
            ray.get(actors[name].stop.remote(), timeout=20)
        except Exception:  # noqa: BLE001 - a dead or stuck actor is killed below anyway
            pass
        ray.kill(actors[name], no_restart=True)
    remove_groups(namespace)
    return order


__all__ = ["Cluster", "ClusterConfig", "PrefillSettings", "DecodeSettings", "ensure_ray", "start_cluster",
           "stop_cluster", "find_actors", "LocalHead", "start_local_head", "use_local_head", "stop_local_head"]
