"""Configuration of the cluster and of each worker process, checked once at construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

MiB = 1 << 20
ROLES = ("gateway", "prefill", "decode", "store")


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

    def __post_init__(self) -> None:
        if not Path(self.model_dir, "config.json").is_file():
            raise FileNotFoundError(f"{self.model_dir} is not a model directory (no config.json)")
        if self.torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1, got {self.torch_threads}")

    def load(self):
        import torch

        from services.engine import Engine

        if self.device == "cpu":
            torch.set_num_threads(self.torch_threads)
        return Engine.load(self.model_dir, device=self.device, dtype=self.dtype, block_size=self.block_size,
                           kv_cache_bytes=self.kv_cache_bytes, chunk_cache_bytes=self.chunk_cache_bytes)


@dataclass(slots=True)
class PrefillSettings:
    quality_floor: float = 0.15             # the loading controller never recomputes less than this
    default_ratio: float | None = None      # a fixed ratio instead of the controller (None: controller)
    # "cost": stream a store-held chunk only when that is measured faster than computing it;
    # "always": stream every store-held chunk
    store_loads: str = "cost"
    # the worker's own host-memory chunk tier (services/cluster/hostcache.py): chunks it wrote to or read
    # from the store, kept pinned for a fast way back to the GPU; 0: off
    host_cache_bytes: int = 0
    # before serving, on a GPU: one made-up prefill per pass the worker runs, over a context of this many
    # tokens, so that no request waits for a kernel compile or a graph capture (services/engine/warmup.py); 0: off
    warmup_tokens: int = 3072

    def __post_init__(self) -> None:
        if self.host_cache_bytes < 0:
            raise ValueError(f"host_cache_bytes must be >= 0, got {self.host_cache_bytes}")
        if self.warmup_tokens < 0:
            raise ValueError(f"warmup_tokens must be >= 0, got {self.warmup_tokens}")
        if self.store_loads not in ("cost", "always"):
            raise ValueError(f"store_loads must be 'cost' or 'always', got {self.store_loads!r}")
        if not 0.0 <= self.quality_floor <= 1.0:
            raise ValueError(f"quality_floor must be in [0, 1], got {self.quality_floor}")
        if self.default_ratio is not None and not 0.0 <= self.default_ratio <= 1.0:
            raise ValueError(f"default_ratio must be in [0, 1], got {self.default_ratio}")


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
    # every live sequence at once. Off (inf) by default: on the H100 at concurrency 32 (bench/cluster.md,
    # round 4) 0.01 s cut tessera's ITL p99 from 1,025 to 216 ms (alpha 2.1) but its steady throughput from
    # 19.7 to 15.9 req/s: about one admission per ~60 ms step fell behind the arrivals
    admit_budget_s: float = float("inf")
    # the shortest time between the starts of two decode steps (0: step as soon as the last one is done).
    # A decode step reads every weight whatever its batch, so on a GPU shared with prefill work, steps of a
    # few sequences each take GPU time the prefills need; an interval trades time per output token for
    # larger batches and that GPU time (the wait admits newly arrived hand-offs)
    min_step_interval_s: float = 0.0
    # before serving, on a GPU: two decode steps at every batch bucket up to max_batch over sequences of this
    # many tokens, so that no step stalls its batch on a kernel compile or a graph capture
    # (services/engine/warmup.py); 0: off
    warmup_tokens: int = 4096

    def __post_init__(self) -> None:
        if self.warmup_tokens < 0:
            raise ValueError(f"warmup_tokens must be >= 0, got {self.warmup_tokens}")
        if not 0 <= self.min_step_interval_s < 10:
            raise ValueError(f"min_step_interval_s must be in [0, 10) seconds, got {self.min_step_interval_s}")
        if self.admit_budget_s < 0:
            raise ValueError(f"admit_budget_s must be >= 0, got {self.admit_budget_s}")
        if self.host_cache_bytes < 0:
            raise ValueError(f"host_cache_bytes must be >= 0, got {self.host_cache_bytes}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.store_wait_s < 0:
            raise ValueError(f"store_wait_s must be >= 0, got {self.store_wait_s}")


@dataclass(slots=True)
class ClusterConfig:
    """What ``tessera up`` starts: N prefill, M decode workers, S store shards and one gateway.

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
    # left dead (-1: always restarted); services/cluster/actors.py, RestartBudget
    max_restarts: int = 5
    restart_window_s: float = 300.0
    text_cache_tokens: int = 8 << 20        # the gateway's token ids of chunk texts seen lately (0: off)
    namespace: str = "tessera"
    detached: bool = False                  # outlive the driver (tessera up)
    gateway_on_head: bool = False           # place the gateway on the Ray head node (a Kubernetes Service's pod)
    prefill_settings: PrefillSettings = field(default_factory=PrefillSettings)
    decode_settings: DecodeSettings = field(default_factory=DecodeSettings)

    def __post_init__(self) -> None:
        for name in ("prefill", "decode"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.stores < 0:
            raise ValueError(f"--stores must be >= 0, got {self.stores}")
        if not 0 <= self.gateway_port < 65536:
            raise ValueError(f"gateway port must be in [0, 65535], got {self.gateway_port}")
        if self.max_restarts < -1:
            raise ValueError(f"--max-restarts must be >= 0 (-1: no limit), got {self.max_restarts}")
        if not self.restart_window_s > 0:
            raise ValueError(f"--restart-window-s must be > 0 seconds, got {self.restart_window_s}")
        if self.text_cache_tokens < 0:
            raise ValueError(f"text_cache_tokens must be >= 0, got {self.text_cache_tokens}")
        if self.store_dram_bytes <= 0:
            raise ValueError("store_dram_bytes must be positive")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        for path in (self.tls_cert, self.tls_key):
            if path is not None and not Path(path).is_file():
                raise FileNotFoundError(f"TLS file {path} does not exist")
        if self.tenants_file is not None:
            if self.token is not None:
                raise ValueError("give either --token or --tenants: a tenants file names every token")
            self.tenants()          # read and checked here, at the boundary: a bad file fails `tessera up`
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

    def tenants(self) -> dict | None:
        """The tenants file as its checked raw mapping (the gateway parses it where it runs), or None."""
        if self.tenants_file is None:
            return None
        from services.gateway.tenants import Tenants

        path = Path(self.tenants_file)
        Tenants.from_file(path)
        import yaml

        return yaml.safe_load(path.read_text())

    def engine(self) -> EngineSettings:
        return EngineSettings(self.model_dir, self.device, self.dtype, self.kv_cache_bytes, self.chunk_cache_bytes)
