"""Configuration of the cluster and of each worker process, checked once at construction."""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from services.checks import check_bool, check_float, check_instance, check_int, check_path, check_str
from services.modes import ROUTINGS

MiB = 1 << 20
ROLES = ("gateway", "prefill", "decode", "store", "index")
MAX_INDEX_THREADS = 1024
# how offloaded keys and values are held on the host (services/index/half.py DTYPES, not imported here: it loads numba)
INDEX_HOST_DTYPES = ("float32", "bfloat16")
# NOTE: copies of the engine's dtype names (services/engine/engine.py DTYPES) and largest block
# (kernels/paged_attention MAX_BLOCK_SIZE), so that checking a config imports no torch;
# tests/test_config_checks.py keeps them equal
DTYPES = ("float32", "fp32", "float16", "fp16", "bfloat16", "bf16")
MAX_BLOCK_SIZE = 64
# "cpu", "cuda" or "cuda:N"; torch keeps a device index in 8 signed bits (cuda:128 wraps to cuda:-128)
DEVICE = re.compile(r"cpu|cuda(?::(0|[1-9][0-9]{0,2}))?")
MAX_DEVICE_INDEX = 127


def check_device(name: str, value) -> None:
    check_str(name, value)
    m = DEVICE.fullmatch(value)
    if m is None or (m.group(1) is not None and int(m.group(1)) > MAX_DEVICE_INDEX):
        raise ValueError(f"{name} must be 'cpu', 'cuda' or 'cuda:N' (N in 0..{MAX_DEVICE_INDEX}), got {value!r}")


def check_token(name: str, value) -> None:
    """None, or a bearer token a client can send in a header: printable ASCII, not empty (never echoed)."""
    if value is None:
        return
    if not isinstance(value, str):
        raise ValueError(f"{name} must be None or a str, got {type(value).__name__}")
    if not (value and value.isascii() and value.isprintable()):
        raise ValueError(f"{name} must be non-empty printable ASCII (a client sends it in a header)")


@dataclass(slots=True)
class EngineSettings:
    """How a worker loads the model (``Engine.load`` arguments)."""

    model_dir: str
    device: str = "cpu"
    dtype: str = "float32"
    kv_cache_bytes: int | None = None       # None: the engine's default (256 MiB on CPU)
    chunk_cache_bytes: int | None = None
    block_size: int = 16
    torch_threads: int = 1                  # CPU workers share cores: one thread each
    # a GPU worker binds its threads to the CPUs local to its GPU (services/cluster/affinity.py) before loading
    cpu_affinity: bool = True
    # how a retrieval sequence's offloaded keys and values are held on the host, and sent to an index service:
    # "float32" or "bfloat16" (half the bytes; EngineOptions.index_host_dtype)
    index_host_dtype: str = "float32"

    def __post_init__(self) -> None:
        check_path("model_dir", self.model_dir)
        if not Path(self.model_dir, "config.json").is_file():
            raise FileNotFoundError(f"{self.model_dir} is not a model directory (no config.json)")
        check_device("device", self.device)
        check_str("dtype", self.dtype, choices=DTYPES)
        check_int("kv_cache_bytes", self.kv_cache_bytes, 1, optional=True, rule="positive")
        check_int("chunk_cache_bytes", self.chunk_cache_bytes, 0, optional=True)
        check_int("block_size", self.block_size, 1, MAX_BLOCK_SIZE)
        check_int("torch_threads", self.torch_threads, 1)
        check_bool("cpu_affinity", self.cpu_affinity)
        check_str("index_host_dtype", self.index_host_dtype, choices=INDEX_HOST_DTYPES)

    def load(self):
        import torch

        from services.engine import Engine

        if self.device == "cpu":
            torch.set_num_threads(self.torch_threads)
        elif self.cpu_affinity:
            from services.cluster.affinity import bind_to_gpu

            # before the engine touches host memory: its pinned buffers land on the GPU's node
            logging.getLogger(__name__).info("CPU affinity: %s", bind_to_gpu(self.device))
        from services.engine.options import EngineOptions

        # the worker's one read of its environment (services/env.py; README "Environment variables")
        options = dataclasses.replace(EngineOptions.from_env(), index_host_dtype=self.index_host_dtype)
        return Engine.load(self.model_dir, device=self.device, dtype=self.dtype, block_size=self.block_size,
                           kv_cache_bytes=self.kv_cache_bytes, chunk_cache_bytes=self.chunk_cache_bytes,
                           options=options)


@dataclass(slots=True)
class PrefillSettings:
    quality_floor: float = 0.15             # the loading controller never recomputes less than this
    default_ratio: float | None = None      # a fixed ratio instead of the controller (None: controller)
    # "cost": stream a store-held chunk only when that is measured faster than computing it;
    # "always": stream every store-held chunk; "never": compute every chunk the GPU lacks (the store path off)
    store_loads: str = "cost"
    # the worker's own host-memory chunk tier (services/cluster/hostcache.py): chunks it wrote to or read
    # from the store, kept pinned for a fast way back to the GPU; 0: off
    host_cache_bytes: int = 0
    # before serving, on a GPU: one made-up prefill per pass the worker runs, over a context of this many
    # tokens, so that no request waits for a kernel compile or a graph capture (services/engine/graphs/warmup.py); 0: off
    warmup_tokens: int = 3072
    # how hand-offs' private K/V reach a decode worker that cannot open this worker's GPU memory (another host, or a
    # process that does not see the GPU): "grpc" in the stream, "nixl" read by the decode worker over NIXL (UCX; the
    # gRPC stream when NIXL cannot load, reported), "auto" gRPC for now (NIXL becomes auto's choice once measured:
    # issue #23); to one that can (the same host's GPUs), CUDA IPC whatever this says. "nixl" also has the worker read
    # chunks of store shards on other hosts from their memory over NIXL (the shards then run a NIXL agent)
    handoff_transport: str = "auto"
    # with "nixl": the memory the worker offers hand-offs from, registered with NIXL once, on its device (a GPU
    # worker's is GPU memory); a hand-off larger than its free room registers memory of its own. 0: no slab
    nixl_slab_bytes: int = 512 << 20
    # the GPU memory the worker shares CUDA IPC hand-offs from, shared once with the decode workers of its host, which
    # keep it open (services/handoff/cuda_ipc.py); a hand-off larger than its free room shares a buffer of its own.
    # 0: every hand-off shares its own buffer, which each decode worker opens and closes
    ipc_slab_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        check_float("quality_floor", self.quality_floor, 0, 1)
        check_int("nixl_slab_bytes", self.nixl_slab_bytes, 0)
        check_int("ipc_slab_bytes", self.ipc_slab_bytes, 0)
        check_str("handoff_transport", self.handoff_transport, choices=("auto", "nixl", "grpc"))
        check_float("default_ratio", self.default_ratio, 0, 1, optional=True)
        check_str("store_loads", self.store_loads, choices=("cost", "always", "never"))
        check_int("host_cache_bytes", self.host_cache_bytes, 0)
        check_int("warmup_tokens", self.warmup_tokens, 0)


@dataclass(slots=True)
class DecodeSettings:
    max_batch: int = 32                     # sequences decoded together in one step
    handoff_wait_s: float = 30.0            # how long Decode waits for its hand-off to arrive
    # how long a hand-off waits (off the engine thread) for a chunk the prefill worker is still writing to
    # the store, before the decode worker computes that chunk itself, in its batch
    store_wait_s: float = 1.0
    host_cache_bytes: int = 0               # as PrefillSettings': chunks read from the store kept in host memory
    # engine-thread time spent admitting new hand-offs between two steps while sequences are decoding (at
    # least one is admitted per step), so that a burst of arrivals is spread over steps instead of stalling
    # every live sequence at once. Off (inf) by default: on the H100 at concurrency 32 (bench/cluster/README.md)
    # 0.01 s cut tessera's ITL p99 from 1,025 to 216 ms (alpha 2.1) but its steady throughput from
    # 19.7 to 15.9 req/s: about one admission per ~60 ms step fell behind the arrivals
    admit_budget_s: float = float("inf")
    # the shortest time between the starts of two decode steps (0: step as soon as the last one is done).
    # A decode step reads every weight whatever its batch, so on a GPU shared with prefill work, steps of a
    # few sequences each take GPU time the prefills need; an interval trades time per output token for
    # larger batches and that GPU time (the wait admits newly arrived hand-offs)
    min_step_interval_s: float = 0.0
    # admit the hand-offs that arrived while a decode step runs on the GPU (issued, its tokens not yet read back),
    # so that an admission's host work overlaps the step instead of following it. Off: measured on four H200s
    # (bench/cluster/README.md, 2026-11-28) it lowered TTFT p50 2.3-3.1x and throughput 15-20%; on two, neither
    admit_during_step: bool = False
    # before serving, on a GPU: two decode steps at every batch bucket up to max_batch over sequences of this
    # many tokens, so that no step stalls its batch on a kernel compile or a graph capture
    # (services/engine/graphs/warmup.py); 0: off
    warmup_tokens: int = 4096
    # the warm-up steps every bucket under Quest's and Retro's default policies too, so that a worker's first sparse
    # requests wait for no compile; it costs start-up time (an H100: 45.8 s of decode warm-up against 14.1 s dense
    # only, bench/warmup/README.md)
    warmup_sparse: bool = True
    # with the cluster's index role (ClusterConfig.index_threads): how long the worker waits for its retrieval
    # index service, per call. A search is one layer of a step for the whole batch, which waits for it; an
    # offload is one layer's K/V and its indexes' build (~9 s a layer at 32K tokens on 16 cores:
    # bench/decode/README.md). Past the deadline the requests concerned fail and the worker goes on serving
    index_search_timeout_s: float = 10.0
    index_offload_timeout_s: float = 600.0
    # hand-offs read over NIXL land in this memory, registered with NIXL once, on the worker's device (then copied
    # out); a larger one registers memory of its own. 0: no slab
    nixl_slab_bytes: int = 512 << 20

    def __post_init__(self) -> None:
        check_int("max_batch", self.max_batch, 1)
        check_int("nixl_slab_bytes", self.nixl_slab_bytes, 0)
        check_float("handoff_wait_s", self.handoff_wait_s, 0, lo_open=True)
        check_float("store_wait_s", self.store_wait_s, 0)
        check_int("host_cache_bytes", self.host_cache_bytes, 0)
        check_float("admit_budget_s", self.admit_budget_s, 0, finite=False)     # inf: no budget (the default)
        check_float("min_step_interval_s", self.min_step_interval_s, 0, 10, hi_open=True, rule="in [0, 10) seconds")
        check_int("warmup_tokens", self.warmup_tokens, 0)
        check_bool("warmup_sparse", self.warmup_sparse)
        check_bool("admit_during_step", self.admit_during_step)
        check_float("index_search_timeout_s", self.index_search_timeout_s, 0, lo_open=True)
        check_float("index_offload_timeout_s", self.index_offload_timeout_s, 0, lo_open=True)


@dataclass(slots=True)
class ClusterConfig:
    """What ``tessera up`` starts: N prefill, M decode workers, S store shards, one gateway and, with
    ``index_threads`` > 0, one retrieval-index service beside each decode worker, on its node.

    ``gateway_port``: 0 picks a free one. ``bind_host``: 127.0.0.1 for one machine; 0.0.0.0 on a
    multi-node Ray cluster (peers then dial each node's IP).
    """

    model_dir: str
    prefill: int = 1
    decode: int = 1
    stores: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    kv_cache_bytes: int | None = None
    chunk_cache_bytes: int | None = None
    store_dram_bytes: int = 256 * MiB
    # each store shard's DRAM tier in shared memory (/dev/shm, where the machine has one): workers on its host read
    # chunks from it at memory speed instead of a gRPC stream (services/kvstore/tiers.py, ShmDramTier)
    store_shm: bool = True
    store_dir: str | None = None            # RocksDB directories go under it (None: DRAM only)
    gateway_port: int = 0
    bind_host: str = "127.0.0.1"
    token: str | None = None                # clients must send it as a bearer token (the one, admin, tenant)
    tenants_file: str | None = None         # tokens -> tenants, namespaces, quotas (services/gateway/tenants.py)
    tls_cert: str | None = None             # gateway over TLS: certificate chain and key (PEM files)
    tls_key: str | None = None
    # mutual TLS between the services (services/cluster/security.py): certificates from certs_dir (ca.pem,
    # <role>.pem, <role>.key), or a development CA minted for this cluster when None; off only for an A/B
    internal_tls: bool = True
    certs_dir: str | None = None
    # a crashed service is restarted at most max_restarts times within any restart_window_s seconds, then
    # left dead (-1: always restarted); services/launch/actors.py, RestartBudget
    max_restarts: int = 5
    restart_window_s: float = 300.0
    text_cache_tokens: int = 8 << 20        # the gateway's token ids of chunk texts seen lately (0: off)
    # how the gateway picks a prefill worker: "residency" (the one holding most of the request's chunk tokens on
    # its GPU, less a load penalty) or "load" (the least loaded: the A/B's peer); services/gateway/router.py
    routing: str = "residency"
    # each GPU worker's threads on the CPUs local to its GPU (EngineSettings.cpu_affinity); off only for an A/B
    cpu_affinity: bool = True
    # each decode worker's retrieval-index service (services/index/, tessera-index-<i>, on the worker's node): the
    # threads it builds and searches with, a share of the node's cores; 0: no index services, decode workers hold
    # their retrieval sequences' K/V and indexes in their own memory
    index_threads: int = 4
    # how retrieval sequences' offloaded keys and values are held (EngineSettings.index_host_dtype), by the decode
    # workers and their index services alike, and sent between them: "float32" or "bfloat16" (half the bytes)
    index_host_dtype: str = "float32"
    namespace: str = "tessera"
    detached: bool = False                  # outlive the driver (tessera up)
    gateway_on_head: bool = False           # place the gateway on the Ray head node (a Kubernetes Service's pod)
    prefill_settings: PrefillSettings = field(default_factory=PrefillSettings)
    decode_settings: DecodeSettings = field(default_factory=DecodeSettings)

    def __post_init__(self) -> None:
        # each field alone (its type and range), then what holds between fields and on disk
        check_path("model_dir", self.model_dir)      # not read here: on a Ray cluster it is the workers' path
        check_int("--prefill", self.prefill, 1)
        check_int("--decode", self.decode, 1)
        check_int("--stores", self.stores, 0)
        check_device("device", self.device)
        check_str("dtype", self.dtype, choices=DTYPES)
        check_int("kv_cache_bytes", self.kv_cache_bytes, 1, optional=True, rule="positive")
        check_int("chunk_cache_bytes", self.chunk_cache_bytes, 0, optional=True)
        check_int("store_dram_bytes", self.store_dram_bytes, 1, rule="positive")
        check_bool("store_shm", self.store_shm)
        check_bool("cpu_affinity", self.cpu_affinity)
        check_path("store_dir", self.store_dir, optional=True)
        check_int("gateway port", self.gateway_port, 0, 65535)
        check_str("bind_host", self.bind_host, empty=False)
        check_token("token", self.token)
        for name in ("tenants_file", "tls_cert", "tls_key", "certs_dir"):
            check_path(name, getattr(self, name), optional=True)
        check_bool("internal_tls", self.internal_tls)
        check_int("--max-restarts", self.max_restarts, -1, rule=">= 0 (-1: no limit)")
        check_float("--restart-window-s", self.restart_window_s, 0, lo_open=True, finite=False, rule="> 0 seconds")
        check_int("text_cache_tokens", self.text_cache_tokens, 0)
        check_str("--routing", self.routing, choices=ROUTINGS)
        check_int("--index-threads", self.index_threads, 0, MAX_INDEX_THREADS)
        check_str("--index-host-dtype", self.index_host_dtype, choices=INDEX_HOST_DTYPES)
        check_str("namespace", self.namespace, empty=False)
        check_bool("detached", self.detached)
        check_bool("gateway_on_head", self.gateway_on_head)
        check_instance("prefill_settings", self.prefill_settings, PrefillSettings)
        check_instance("decode_settings", self.decode_settings, DecodeSettings)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        for path in (self.tls_cert, self.tls_key):
            if path is not None and not Path(path).is_file():
                raise FileNotFoundError(f"TLS file {path} does not exist")
        if self.tenants_file is not None:
            if self.token is not None:
                raise ValueError("give either --token or --tenants: a tenants file names every token")
            if not Path(self.tenants_file).is_file():
                raise FileNotFoundError(f"tenants file {self.tenants_file} does not exist")
        if self.certs_dir is not None and not self.internal_tls:
            raise ValueError("certs_dir is given but internal_tls is off")
        if self.certs_dir is not None and not Path(self.certs_dir, "ca.pem").is_file():
            raise FileNotFoundError(f"{self.certs_dir} holds no ca.pem (make the cluster's certificates with "
                                    f"`tessera certs {self.certs_dir}`)")

    def tls(self) -> tuple[bytes, bytes] | None:
        """(certificate chain PEM, private key PEM), read here so that remote nodes need no copy."""
        if self.tls_cert is None:
            return None
        return Path(self.tls_cert).read_bytes(), Path(self.tls_key).read_bytes()

    def engine(self) -> EngineSettings:
        return EngineSettings(self.model_dir, self.device, self.dtype, self.kv_cache_bytes, self.chunk_cache_bytes,
                              cpu_affinity=self.cpu_affinity, index_host_dtype=self.index_host_dtype)
