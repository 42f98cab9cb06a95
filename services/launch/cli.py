"""``tessera up``, ``tessera down``, ``tessera demo``.

``up`` with no ``--address`` starts a Ray head of the cluster's own (``on_ray.start_local_head``:
listening on loopback only, token authentication on, its own temp dir), writes the tiny model and
uses temporary RocksDB directories: the embedded default. With ``--address`` it joins that Ray
cluster. Actors are detached, so the cluster outlives the command; what ``up`` started is written
to a state file (the head's GCS address, token and temp dir among it) that ``down`` reads to stop
it: the actors, then that head's processes only, then the temporary files.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from services import env
from services.modes import ROUTINGS

STATE = Path(env.read("TESSERA_STATE") or Path.home() / ".tessera" / "cluster.json")


def register(subparsers: argparse._SubParsersAction) -> None:
    up = subparsers.add_parser("up", help="start the cluster (local Ray + tiny model by default)",
                               description="Start the gateway, prefill/decode workers, KV store shards and a retrieval "
                                           "index service beside each decode worker on Ray.")
    up.add_argument("--address", help="join this Ray cluster (default: start a local one)")
    up.add_argument("--model", help="model directory, readable on every node (default without --address: the tiny "
                                    "model, written to a temporary directory)")
    up.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    up.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    up.add_argument("--stores", type=int, default=1, help="KV store shards (default 1; 0: no store)")
    up.add_argument("--index-threads", type=int, default=4,
                    help="each decode worker's retrieval index service (tessera-index-<i>, on the worker's node, CPU "
                         "only) builds and searches with this many threads (default 4; 0: no index services)")
    up.add_argument("--no-index", dest="index_threads", action="store_const", const=0,
                    help="start no retrieval index services: decode workers keep decode='retrieval' K/V and indexes "
                         "in their own memory")
    up.add_argument("--index-host-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="how decode='retrieval' sequences' offloaded keys and values are held on the host and sent to "
                         "the index service: float32 (default) or bfloat16, half the bytes (512K tokens of an 8B "
                         "model: 69 GB against 137), the keys rounded once more")
    up.add_argument("--handoff-transport", choices=("auto", "nixl", "grpc"), default="auto",
                    help="how a hand-off's K/V reach a decode worker on another GPU or host: nixl (read over NIXL/UCX, "
                         "checked on landing; the gRPC stream when NIXL cannot load, reported in Stats), grpc (in the "
                         "stream), auto (gRPC for now). To a decode worker on this host's GPUs: CUDA IPC whatever this "
                         "says")
    up.add_argument("--nixl-slab-mb", type=int, default=512,
                    help="with --handoff-transport nixl: each worker's hand-off memory registered with NIXL once, "
                         "on its device, in MiB (default 512; 0: every hand-off registers its own)")
    up.add_argument("--ipc-slab-mb", type=int, default=1024,
                    help="each GPU prefill worker's memory its CUDA IPC hand-offs to the same host's decode workers "
                         "go through, shared once, in MiB (default 1024; 0: every hand-off shares a buffer of its own)")
    up.add_argument("--store-loads", choices=("cost", "always", "never"), default="cost",
                    help="whether prefill workers load a chunk the store holds: cost (when the loading controller "
                         "measured that cheaper than computing it; the default), always, or never (every chunk the "
                         "GPU lacks is computed: the store path off, for an A/B)")
    up.add_argument("--port", type=int, default=50051, help="gateway port (default 50051; 0: any free port)")
    up.add_argument("--host", default=None, help="bind address (default 127.0.0.1 locally, 0.0.0.0 with --address)")
    up.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    up.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bf16 on cuda, fp32 on cpu)")
    up.add_argument("--store-dir", help="RocksDB directories go here (default: a temporary directory)")
    up.add_argument("--host-cache-gb", type=float, default=0.0,
                    help="each worker's own host-memory chunk tier, GB (default 0: off); pinned on a GPU")
    up.add_argument("--decode-step-interval-ms", type=float, default=0.0,
                    help="shortest time between two decode steps (0: as soon as the last one ends); on a GPU "
                         "shared with prefill workers, steps of a few sequences take GPU time the prefills need")
    up.add_argument("--admit-during-step", action="store_true",
                    help="decode workers admit the hand-offs that arrived while a step runs on the GPU, beside it, "
                         "instead of after it (DecodeSettings.admit_during_step): on four H200s a lower TTFT p50 "
                         "(2.3-3.1x) for 15-20%% less throughput")
    up.add_argument("--gateway-on-head", action="store_true",
                    help="with --address: run the gateway on the Ray head node, where a Kubernetes Service in front "
                         "of the head pod reaches it (the Helm chart, helm/tessera)")
    up.add_argument("--warmup-tokens", type=int, default=None,
                    help="on a GPU, each worker's start-up warm-up (every kernel compiled and decode graph captured "
                         "before it serves) runs over a made-up context of this many tokens (default: prefill 3072, "
                         "decode 4096; 0: off)")
    up.add_argument("--no-warmup-sparse", dest="warmup_sparse", action="store_false",
                    help="decode workers warm up dense decode only, not Quest's and Retro's default policies too "
                         "(a shorter start; a worker's first sparse requests then wait for kernel compiles)")
    up.add_argument("--no-store-shm", dest="store_shm", action="store_false",
                    help="keep each store shard's DRAM tier in its own memory, streamed to every worker over gRPC "
                         "(default: in /dev/shm, read by the workers on its host themselves)")
    up.add_argument("--no-cpu-affinity", dest="cpu_affinity", action="store_false",
                    help="leave GPU workers where the scheduler puts them (default: each binds its threads to the "
                         "CPUs local to its GPU, ClusterConfig.cpu_affinity)")
    up.add_argument("--routing", choices=ROUTINGS, default="residency",
                    help="how the gateway picks a prefill worker: the one holding most of the request's chunk tokens "
                         "on its GPU, less a load penalty (default), or the least loaded")
    up.add_argument("--text-cache-tokens", type=int, default=8 << 20,
                    help="token ids of chunk texts the gateway keeps for requests that send them again, in tokens "
                         "(default 8M, ~4 bytes each plus the text; 0: tokenize every text every time)")
    up.add_argument("--certs-dir", help="the cluster's mutual-TLS certificates (ca.pem, <role>.pem, <role>.key; "
                                        "`tessera certs DIR` makes a development set); default: a development CA "
                                        "minted for this cluster")
    up.add_argument("--max-restarts", type=int, default=None,
                    help="a crashed service is restarted at most this many times within --restart-window-s, then "
                         "left dead (default 5; -1: no limit)")
    up.add_argument("--restart-window-s", type=float, default=None,
                    help="the window of --max-restarts, in seconds (default 300)")
    up.add_argument("--token", default=env.read("TESSERA_TOKEN"), help="bearer token clients must send")
    up.add_argument("--tenants", help="tenants file (YAML): bearer tokens -> tenants, each with its own chunk "
                                      "namespace, the shared namespaces it reads, quotas and admin rights (README, "
                                      "Security model); instead of --token")
    up.add_argument("--tls-cert", help="serve the client API over TLS with this certificate chain (PEM)")
    up.add_argument("--tls-key", help="the private key of --tls-cert (PEM)")
    up.set_defaults(handler=_up)

    certs = subparsers.add_parser("certs", help="make a development cluster CA and a certificate per role",
                                  description="Write a development CA (ca.pem, ca.key) and one certificate and key per "
                                              "role (gateway, prefill, decode, store, index, admin) into DIR, keys "
                                              "readable by their owner only. Services authenticate each other with "
                                              "them (mutual TLS): `tessera up --certs-dir DIR`, or a Kubernetes "
                                              "Secret of the same files.")
    certs.add_argument("dir", help="directory to write (created with mode 0700)")
    certs.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    certs.add_argument("--host", action="append", default=[],
                       help="an extra DNS name or IP address every certificate names (repeatable)")
    certs.add_argument("--force", action="store_true", help="overwrite certificates already in DIR")
    certs.set_defaults(handler=_certs)

    down = subparsers.add_parser("down", help="stop what `tessera up` started")
    down.add_argument("--address", help="Ray cluster to stop Tessera on (default: the one `up` recorded)")
    down.set_defaults(handler=_down)

    demo = subparsers.add_parser("demo", help="up, replay a small Zipf trace in full and tessera mode, report, down")
    demo.add_argument("--requests", type=int, default=None, help="requests in the trace (default 48)")
    demo.add_argument("--output", help="also write the full replay report (JSON, plots) here")
    demo.set_defaults(handler=_demo)


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _ray_cli() -> str:
    exe = Path(sys.executable).with_name("ray")
    return str(exe) if exe.exists() else "ray"


def _up(args: argparse.Namespace) -> int:
    from services.cluster.config import ClusterConfig, DecodeSettings, PrefillSettings
    from services.launch.plan import checked_tenants
    from services.launch.on_ray import ensure_ray, start_cluster, start_local_head, use_local_head

    if STATE.exists():
        raise ValueError(f"a cluster is already up ({STATE}); run `tessera down` first")
    if args.address and not args.model:
        # the tiny model would be written on this machine only; workers may land on other nodes
        raise ValueError("--address needs --model: a model directory every node of the Ray cluster can read")
    if args.model and not Path(args.model, "config.json").is_file():
        raise FileNotFoundError(f"{args.model} is not a model directory (no config.json)")
    cuda = args.device == "cuda" or (args.device is None and _cuda())
    device = args.device or ("cuda" if cuda else "cpu")
    state: dict = {"temp": []}
    model = args.model
    if model is None:
        from services.engine.model.tiny import write_tiny

        tmp = tempfile.mkdtemp(prefix="tessera-model-")
        state["temp"].append(tmp)
        model = str(write_tiny(Path(tmp) / "tiny-llama"))
        print(f"tiny model written to {model}", file=sys.stderr)
    store_dir = args.store_dir
    if store_dir is None and args.stores:
        store_dir = tempfile.mkdtemp(prefix="tessera-rocksdb-")
        state["temp"].append(store_dir)
    host = args.host or ("0.0.0.0" if args.address else "127.0.0.1")
    warm = {} if args.warmup_tokens is None else {"warmup_tokens": args.warmup_tokens}
    restarts = {k: v for k, v in (("max_restarts", args.max_restarts), ("restart_window_s", args.restart_window_s))
                if v is not None}
    cfg = ClusterConfig(model_dir=model, prefill=args.prefill, decode=args.decode, stores=args.stores, device=device,
                        dtype=args.dtype or ("bfloat16" if cuda else "float32"), store_dir=store_dir,
                        gateway_port=args.port, bind_host=host, token=args.token, tls_cert=args.tls_cert,
                        certs_dir=args.certs_dir, tenants_file=args.tenants,
                        tls_key=args.tls_key, detached=True, text_cache_tokens=args.text_cache_tokens,
                        routing=args.routing, store_shm=args.store_shm,
                        cpu_affinity=args.cpu_affinity,
                        gateway_on_head=args.gateway_on_head, index_threads=args.index_threads,
                        index_host_dtype=args.index_host_dtype, **restarts,
                        prefill_settings=PrefillSettings(host_cache_bytes=int(args.host_cache_gb * 1e9),
                                                         handoff_transport=args.handoff_transport,
                                                         store_loads=args.store_loads,
                                                         nixl_slab_bytes=args.nixl_slab_mb << 20,
                                                         ipc_slab_bytes=args.ipc_slab_mb << 20, **warm),
                        decode_settings=DecodeSettings(host_cache_bytes=int(args.host_cache_gb * 1e9),
                                                       nixl_slab_bytes=args.nixl_slab_mb << 20,
                                                       min_step_interval_s=args.decode_step_interval_ms / 1e3,
                                                       admit_during_step=args.admit_during_step,
                                                       warmup_sparse=args.warmup_sparse, **warm))
    address = args.address
    try:
        checked_tenants(cfg)            # a bad tenants file starts nothing, not even Ray
        if address is None:
            n_cpus = args.prefill + args.decode + 1
            print(f"starting a local Ray head ({n_cpus} logical CPUs, loopback only)", file=sys.stderr)
            head = start_local_head(n_cpus, STATE.parent, _ray_cli())
            state["head"] = asdict(head)
            use_local_head(head)
            address = head.address
        ensure_ray(address)
        cluster = start_cluster(cfg, progress=lambda m: print(m, file=sys.stderr))
    except BaseException:
        _cleanup(state)
        raise
    if cluster.shm_scratch:             # the store shards' shared-memory DRAM tiers: removed by `tessera down`
        state["temp"].append(cluster.shm_scratch)
    state.update(address=args.address, namespace=cfg.namespace, gateway=cluster.gateway_address,
                 actors=sorted(cluster.actors))
    STATE.parent.mkdir(parents=True, exist_ok=True)
    STATE.write_text(json.dumps(state, indent=2))
    for name in sorted(cluster.actors):
        print(f"  {name:<20} {cluster.addresses[name]:<22} {cluster.metrics[name]}", file=sys.stderr)
    indexes = cfg.decode if cfg.index_threads else 0
    print(f"Tessera is up: gateway {cluster.gateway_address} ({cfg.prefill} prefill, {cfg.decode} decode, "
          f"{cfg.stores} store shard(s), {indexes} index service(s), {device}); stop with `tessera down`")
    print(cluster.gateway_address)
    return 0


def _certs(args: argparse.Namespace) -> int:
    from services.cluster.security import mint

    if Path(args.dir, "ca.pem").exists() and not args.force:
        raise ValueError(f"{args.dir} already holds a CA (ca.pem): pass --force to replace every certificate in it")
    out = mint(args.dir, days=args.days, hosts=tuple(args.host))
    print(f"cluster CA and certificates for every role written to {out} (keys readable by you only)", file=sys.stderr)
    return 0


def _cleanup(state: dict) -> None:
    if state.get("head"):
        from services.launch.on_ray import LocalHead, stop_local_head

        stopped = stop_local_head(LocalHead(**state["head"]))
        print(f"stopped the local Ray head ({stopped} process(es))", file=sys.stderr)
    for path in state.get("temp", []):
        shutil.rmtree(path, ignore_errors=True)


def _down(args: argparse.Namespace) -> int:
    from services.launch.on_ray import LocalHead, stop_cluster, use_local_head

    state = json.loads(STATE.read_text()) if STATE.exists() else {}
    if not state and not args.address:
        raise ValueError(f"nothing to stop: no {STATE} (was the cluster started with `tessera up`?)")
    head = LocalHead(**state["head"]) if state.get("head") else None
    if head is not None:
        use_local_head(head)       # before ray is imported
    address = args.address or state.get("address") or (head.address if head else None)
    if address is None:
        raise ValueError(f"{STATE} records no Ray address: pass --address")
    import ray

    try:
        ray.init(address=address, namespace=state.get("namespace", "tessera"), log_to_driver=False)
        stopped = stop_cluster(state.get("namespace", "tessera"))
        ray.shutdown()
        print(f"stopped {len(stopped)} actor(s)", file=sys.stderr)
    except ConnectionError as exc:
        print(f"Ray at {address} is not reachable ({exc}); cleaning up local state", file=sys.stderr)
    _cleanup(state)
    STATE.unlink(missing_ok=True)
    print("Tessera is down")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from services.launch.demo import DemoSettings, run_demo

    settings = DemoSettings() if args.requests is None else DemoSettings(requests=args.requests)
    return run_demo(settings, output=args.output)
