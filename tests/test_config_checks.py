"""The config dataclasses check every field at construction (services/checks.py): a wrong type, NaN, an
infinity where none is meant, a value out of range are each refused with a ValueError naming the field and the
value; valid values (defaults, ints for floats, documented infinities, path objects) are built unchanged.
tests/fuzz/test_config_fuzz.py fuzzes the same property over every field."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from services.cluster.config import ClusterConfig, DecodeSettings, EngineSettings, PrefillSettings
from services.engine.sampling import SamplingParams
from services.kvstore.config import S3Config, StoreConfig

NAN, INF = math.nan, math.inf


@pytest.fixture
def model_dir(tmp_path) -> str:
    (tmp_path / "config.json").write_text("{}")     # all EngineSettings looks at
    return str(tmp_path)


def build(cls, a_model_dir: str, **fields):
    """``cls`` with its required fields filled in (a model directory, an S3 bucket), then ``fields``."""
    required = {"model_dir": a_model_dir} if cls in (ClusterConfig, EngineSettings) else {}
    if cls is S3Config:
        required = {"endpoint_url": None, "bucket": "b"}
    return cls(**{**required, **fields})


def short(value) -> str:
    """A test id's value: repr, cut short (an int past 4300 digits has no repr at all)."""
    return "huge" if isinstance(value, int) and abs(value) > 10**30 else repr(value)[:40]


BAD = [
    # ---- ClusterConfig
    (ClusterConfig, "model_dir", None, "model_dir must be a path"),
    (ClusterConfig, "prefill", True, "--prefill must be an integer, got True (bool)"),
    (ClusterConfig, "prefill", 1.5, "--prefill must be an integer, got 1.5 (float)"),
    (ClusterConfig, "decode", NAN, "--decode must be an integer"),
    (ClusterConfig, "stores", "1", "--stores must be an integer, got '1' (str)"),
    (ClusterConfig, "stores", -1, "--stores must be >= 0, got -1"),
    (ClusterConfig, "device", "abc", "device must be 'cpu', 'cuda' or 'cuda:N'"),
    (ClusterConfig, "device", None, "device must be a str, got None"),
    (ClusterConfig, "dtype", "", "dtype must be one of"),
    (ClusterConfig, "kv_cache_bytes", NAN, "kv_cache_bytes must be an integer"),
    (ClusterConfig, "kv_cache_bytes", 0, "kv_cache_bytes must be positive, got 0"),
    (ClusterConfig, "chunk_cache_bytes", -1, "chunk_cache_bytes must be >= 0, got -1"),
    (ClusterConfig, "store_dram_bytes", INF, "store_dram_bytes must be an integer"),
    (ClusterConfig, "store_dir", b"/tmp/x", "store_dir must be a path (str or os.PathLike), got b'/tmp/x' (bytes)"),
    (ClusterConfig, "gateway_port", 1.5, "gateway port must be an integer"),
    (ClusterConfig, "gateway_port", 65536, "gateway port must be in [0, 65535], got 65536"),
    (ClusterConfig, "bind_host", None, "bind_host must be a str"),
    (ClusterConfig, "token", "", "token must be non-empty printable ASCII"),
    (ClusterConfig, "token", 1, "token must be None or a str"),
    (ClusterConfig, "tenants_file", 1, "tenants_file must be a path"),
    (ClusterConfig, "tls_cert", NAN, "tls_cert must be a path"),
    (ClusterConfig, "internal_tls", "false", "internal_tls must be True or False, got 'false' (str)"),
    (ClusterConfig, "certs_dir", "", "certs_dir must be a non-empty path"),
    (ClusterConfig, "max_restarts", None, "--max-restarts must be an integer"),
    (ClusterConfig, "max_restarts", -2, "--max-restarts must be >= 0 (-1: no limit), got -2"),
    (ClusterConfig, "restart_window_s", "1", "--restart-window-s must be a number, got '1' (str)"),
    (ClusterConfig, "restart_window_s", NAN, "--restart-window-s must be > 0 seconds, got nan"),
    (ClusterConfig, "index_threads", -1, "--index-threads must be in [0, 1024], got -1"),
    (ClusterConfig, "index_threads", 2.0, "--index-threads must be an integer, got 2.0 (float)"),
    (ClusterConfig, "text_cache_tokens", -1, "text_cache_tokens must be >= 0"),
    (ClusterConfig, "namespace", "", "namespace must not be empty"),
    (ClusterConfig, "detached", 0, "detached must be True or False, got 0 (int)"),
    (ClusterConfig, "gateway_on_head", None, "gateway_on_head must be True or False"),
    (ClusterConfig, "prefill_settings", {}, "prefill_settings must be a PrefillSettings, got {} (dict)"),
    (ClusterConfig, "decode_settings", None, "decode_settings must be a DecodeSettings"),
    # ---- EngineSettings
    (EngineSettings, "model_dir", 1, "model_dir must be a path"),
    (EngineSettings, "device", "cuda:128", "device must be 'cpu', 'cuda' or 'cuda:N'"),   # torch would wrap it
    (EngineSettings, "device", "cuda:01", "device must be"),
    (EngineSettings, "dtype", "abc", "dtype must be one of"),
    (EngineSettings, "kv_cache_bytes", "1", "kv_cache_bytes must be an integer"),
    (EngineSettings, "chunk_cache_bytes", 1.5, "chunk_cache_bytes must be an integer"),
    (EngineSettings, "block_size", 0, "block_size must be in [1, 64], got 0"),
    (EngineSettings, "block_size", 65, "block_size must be in [1, 64], got 65"),
    (EngineSettings, "torch_threads", True, "torch_threads must be an integer, got True (bool)"),
    # ---- PrefillSettings
    (PrefillSettings, "quality_floor", NAN, "quality_floor must be in [0, 1], got nan"),
    (PrefillSettings, "quality_floor", "1", "quality_floor must be a number, got '1' (str)"),
    (PrefillSettings, "default_ratio", True, "default_ratio must be a number, got True (bool)"),
    (PrefillSettings, "store_loads", None, "store_loads must be a str"),
    (PrefillSettings, "store_loads", "sometimes", "store_loads must be one of ('cost', 'always', 'never'), got 'sometimes'"),
    (PrefillSettings, "host_cache_bytes", INF, "host_cache_bytes must be an integer"),
    (PrefillSettings, "warmup_tokens", -1, "warmup_tokens must be >= 0, got -1"),
    # ---- DecodeSettings
    (DecodeSettings, "max_batch", True, "max_batch must be an integer"),
    (DecodeSettings, "max_batch", 0, "max_batch must be >= 1, got 0"),
    (DecodeSettings, "handoff_wait_s", -1, "handoff_wait_s must be a finite number > 0, got -1"),
    (DecodeSettings, "handoff_wait_s", 0, "handoff_wait_s must be a finite number > 0, got 0"),
    (DecodeSettings, "handoff_wait_s", INF, "handoff_wait_s must be a finite number > 0, got inf"),
    (DecodeSettings, "store_wait_s", NAN, "store_wait_s must be a finite number >= 0, got nan"),
    (DecodeSettings, "host_cache_bytes", None, "host_cache_bytes must be an integer"),
    (DecodeSettings, "admit_budget_s", NAN, "admit_budget_s must be >= 0, got nan"),
    (DecodeSettings, "admit_budget_s", "1", "admit_budget_s must be a number"),
    (DecodeSettings, "min_step_interval_s", None, "min_step_interval_s must be a number"),
    (DecodeSettings, "min_step_interval_s", 10, "min_step_interval_s must be in [0, 10) seconds, got 10"),
    (DecodeSettings, "warmup_tokens", 1.5, "warmup_tokens must be an integer"),
    (DecodeSettings, "warmup_sparse", "false", "warmup_sparse must be"),
    (DecodeSettings, "index_search_timeout_s", 0, "index_search_timeout_s must be a finite number > 0, got 0"),
    (DecodeSettings, "index_offload_timeout_s", INF, "index_offload_timeout_s must be a finite number > 0, got inf"),
    # ---- SamplingParams
    (SamplingParams, "temperature", None, "temperature must be a number, got None"),
    (SamplingParams, "temperature", "1", "temperature must be a number"),
    (SamplingParams, "temperature", NAN, "temperature must be a finite number >= 0, got nan"),
    (SamplingParams, "temperature", 10**400, "temperature must be a finite number >= 0"),    # no OverflowError
    (SamplingParams, "temperature", 10**5000, "temperature must be a finite number >= 0, got an integer of"),
    (SamplingParams, "top_p", 0, "top_p must be in (0, 1], got 0"),
    (SamplingParams, "top_k", True, "top_k must be an integer"),
    (SamplingParams, "top_k", -1, "top_k must be >= 0, got -1"),
    (SamplingParams, "seed", "1", "seed must be an integer, got '1' (str)"),
    (SamplingParams, "seed", 1.5, "seed must be an integer"),
    (SamplingParams, "seed", 2**64, "seed must be in [-2**63, 2**64 - 1], got 18446744073709551616"),
    (SamplingParams, "seed", -(10**5000), "seed must be in [-2**63, 2**64 - 1], got an integer of"),   # no repr limit
    (SamplingParams, "max_new_tokens", NAN, "max_new_tokens must be an integer"),
    # ---- StoreConfig
    (StoreConfig, "dram_bytes", True, "dram_bytes must be an integer, got True (bool)"),
    (StoreConfig, "dram_bytes", NAN, "dram_bytes must be an integer"),
    (StoreConfig, "dram_bytes", 0, "dram_bytes must be positive, got 0"),
    (StoreConfig, "rocksdb_dir", 1, "rocksdb_dir must be a path"),
    (StoreConfig, "rocksdb_dir", "db\x00", "rocksdb_dir must be a non-empty path without NUL characters"),
    (StoreConfig, "rocksdb_bytes", "1", "rocksdb_bytes must be an integer"),
    (StoreConfig, "s3", {}, "s3 must be None or a S3Config, got {} (dict)"),
    (StoreConfig, "policy", None, "policy must be a str"),
    (StoreConfig, "write_mode", "later", "write_mode must be one of ('through', 'behind'), got 'later'"),
    (StoreConfig, "frame_bytes", 4095, "frame_bytes must be within [4096, 3 MiB], got 4095"),
    (StoreConfig, "rocksdb_sync", "false", "rocksdb_sync must be True or False, got 'false' (str)"),
    (StoreConfig, "max_chunk_bytes", -1, "max_chunk_bytes must be positive, got -1"),
    # ---- S3Config
    (S3Config, "endpoint_url", 1, "endpoint_url must be a str"),
    (S3Config, "bucket", None, "bucket must be a str"),
    (S3Config, "prefix", None, "prefix must be a str"),
    (S3Config, "region", 1, "region must be a str"),
    (S3Config, "create_bucket", "false", "create_bucket must be True or False"),
]


@pytest.mark.parametrize("cls, name, value, message", BAD,
                         ids=[f"{c.__name__}.{n}={short(v)}" for c, n, v, _ in BAD])
def test_a_bad_value_is_refused_naming_the_field_and_the_value(cls, name, value, message, model_dir):
    with pytest.raises(ValueError) as info:
        build(cls, model_dir, **{name: value})
    assert message in str(info.value)


def test_the_messages_that_users_and_tests_know_are_kept(model_dir, tmp_path):
    cases = [
        (lambda: ClusterConfig(model_dir, prefill=0), "--prefill must be >= 1, got 0"),
        (lambda: ClusterConfig(model_dir, text_cache_tokens=-1), "text_cache_tokens must be >= 0, got -1"),
        (lambda: ClusterConfig(model_dir, restart_window_s=0), "--restart-window-s must be > 0 seconds, got 0"),
        (lambda: ClusterConfig(model_dir, tls_cert=str(tmp_path / "c.pem")), "TLS needs both --tls-cert and --tls-key"),
        (lambda: ClusterConfig(model_dir, token="t", tenants_file=str(tmp_path / "t.yaml")), "give either --token"),
        (lambda: ClusterConfig(model_dir, certs_dir=str(tmp_path), internal_tls=False), "internal_tls is off"),
        (lambda: SamplingParams(temperature=INF), "temperature must be a finite number >= 0, got inf"),
        (lambda: SamplingParams(top_p=NAN), "top_p must be in (0, 1], got nan"),
        (lambda: S3Config(endpoint_url=None, bucket=""), "S3 bucket name must not be empty"),
        (lambda: S3Config(endpoint_url="ftp://x", bucket="b"), "S3 endpoint must be an http(s) URL"),
    ]
    for make, message in cases:
        with pytest.raises(ValueError) as info:
            make()
        assert message in str(info.value)


def test_a_path_that_must_exist_still_raises_file_not_found(model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a model directory"):
        EngineSettings(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="TLS file"):
        ClusterConfig(model_dir, tls_cert=str(tmp_path / "c.pem"), tls_key=str(tmp_path / "k.pem"))
    with pytest.raises(FileNotFoundError, match="holds no ca.pem"):
        ClusterConfig(model_dir, certs_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="rocksdb-dir"):
        StoreConfig(rocksdb_dir=str(tmp_path / "no" / "db"))


def test_secrets_are_never_echoed_in_a_refusal(model_dir):
    with pytest.raises(ValueError) as info:
        ClusterConfig(model_dir, token="hunter2\n")
    assert "hunter2" not in str(info.value)
    with pytest.raises(ValueError) as info:
        S3Config(endpoint_url=None, bucket="b", secret_access_key=b"hunter2")
    assert "secret_access_key" in str(info.value) and "hunter2" not in str(info.value)


def test_valid_values_are_built_unchanged(model_dir, tmp_path):
    for cls in (ClusterConfig, EngineSettings, PrefillSettings, DecodeSettings, SamplingParams, StoreConfig, S3Config):
        build(cls, model_dir)                                  # every default is valid
    assert DecodeSettings().admit_budget_s == INF              # documented: no budget
    assert ClusterConfig(model_dir, restart_window_s=INF).restart_window_s == INF
    assert ClusterConfig(model_dir, max_restarts=-1).max_restarts == -1
    # an int where a float goes is kept as it is, never converted
    p = SamplingParams(temperature=1, top_p=1, seed=2**64 - 1)
    assert (p.temperature, p.top_p, p.seed) == (1, 1, 2**64 - 1) and type(p.temperature) is int
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert DecodeSettings(handoff_wait_s=1, min_step_interval_s=0.005).handoff_wait_s == 1
    for device in ("cpu", "cuda", "cuda:0", "cuda:7", "cuda:127"):
        assert EngineSettings(model_dir, device=device).device == device
        assert ClusterConfig(model_dir, device=device).device == device
    assert EngineSettings(Path(model_dir), dtype="bf16", block_size=64).model_dir == Path(model_dir)
    assert StoreConfig(rocksdb_dir=tmp_path / "db", s3=S3Config(None, "b")).rocksdb_dir == tmp_path / "db"
    assert ClusterConfig(model_dir, token="acme-token 01").token == "acme-token 01"


def test_the_copied_engine_constants_match_the_engine():
    """services/cluster/config.py keeps the engine's dtype names, block limit and index host dtypes without importing
    torch (or numba)."""
    import torch

    from kernels.paged_attention import MAX_BLOCK_SIZE
    from services.cluster import config
    from services.engine.engine import DTYPES

    assert set(config.DTYPES) == set(DTYPES)
    assert config.MAX_BLOCK_SIZE == MAX_BLOCK_SIZE
    from services.index import half

    assert config.INDEX_HOST_DTYPES == half.DTYPES
    for index in (0, 1, 127):
        assert torch.device(f"cuda:{index}").index == index     # every index the config takes, torch keeps


def test_checking_a_config_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys; import services.cluster.config, services.kvstore.config, services.checks; "
            "assert 'torch' not in sys.modules and 'grpc' not in sys.modules, 'torch or grpc imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
