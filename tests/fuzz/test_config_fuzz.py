"""Fuzzing the config dataclasses with random field values.

Property, for every field of ClusterConfig, EngineSettings, PrefillSettings, DecodeSettings (services/cluster/
config.py), SamplingParams (services/engine/sampling.py) and StoreConfig (services/kvstore/config.py): building
the dataclass with one field set to any Python value either succeeds with a value inside the field's domain, or
raises ValueError / FileNotFoundError whose message names the field. Never another exception from deep inside
(``TypeError: '<' not supported ...``), never an object holding NaN, a str where a count goes, a count out of
its range.

A field's domain is what its comment, its check and its consumer say (``Field.ok``). Each field is one test
case: a fixed list of edge values first (deterministic), then random values. Every field holds the property: each
is checked at construction (services/checks.py).
"""

from __future__ import annotations

import decimal
import fractions
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from .common import FUZZ, expect

NAN, INF = math.nan, math.inf


def is_int(v) -> bool:
    """An integer count (a bool is an int to Python; a float, even 2.0, is not)."""
    return isinstance(v, int)


def int_in(lo, hi=None) -> Callable[[object], bool]:
    return lambda v: is_int(v) and lo <= v and (hi is None or v <= hi)


def opt(ok: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda v: v is None or ok(v)


def real_in(lo, hi, lo_open=False, hi_open=False, finite=True) -> Callable[[object], bool]:
    """A real number within [lo, hi] (bounds open as asked); NaN never, inf only if ``finite`` is off."""
    def ok(v):
        if not isinstance(v, (int, float, fractions.Fraction)):
            return False
        f = float(v) if not isinstance(v, int) or abs(v) < 2**1000 else (INF if v > 0 else -INF)
        if math.isnan(f) or (finite and math.isinf(f)):
            return False
        return (lo < f if lo_open else lo <= f) and (f < hi if hi_open else f <= hi)
    return ok


def is_bool(v) -> bool:
    return isinstance(v, bool)


def stop_ids(v) -> bool:
    """A frozenset of token ids (ints >= 0, bools not ints here)."""
    return isinstance(v, frozenset) and all(is_int(t) and t >= 0 for t in v)


def is_str(v) -> bool:
    return isinstance(v, str)


def one_of(*choices) -> Callable[[object], bool]:
    return lambda v: isinstance(v, str) and v in choices


def torch_device(v) -> bool:
    import torch

    if not isinstance(v, str):
        return False
    try:
        return torch.device(v).type in ("cpu", "cuda")
    except (RuntimeError, ValueError):
        return False


def engine_dtype(v) -> bool:
    from services.engine.engine import DTYPES

    return isinstance(v, str) and v in DTYPES


def block_size(v) -> bool:
    from kernels.paged_attention import MAX_BLOCK_SIZE

    return is_int(v) and 1 <= v <= MAX_BLOCK_SIZE


def header_token(v) -> bool:
    """A bearer token a client can send (printable ASCII, as the SDK requires), not empty (the gateway refuses an
    empty one as it starts: services/gateway/tenants.py Tenants.single)."""
    return v is None or (isinstance(v, str) and v != "" and v.isascii() and v.isprintable())


@dataclass(frozen=True)
class Field:
    cls: str                       # "ClusterConfig", ...
    name: str
    ok: Callable[[object], bool]   # the field's domain
    good: tuple = ()               # values of the domain worth trying besides the edges
    names: tuple[str, ...] = ()    # how a refusal may name the field, besides name, name-with-dashes, -with-spaces
    extra: dict = field(default_factory=dict)   # other fields the case needs (a rocksdb_dir for rocksdb_bytes)

    @property
    def id(self) -> str:
        return f"{self.cls}.{self.name}"


# Values every field is tried with, first: the edges of numbers and of types.
EDGES = (None, True, False, 0, 1, -1, 2, 2**31, 2**64, -(2**63), 10**30, 10**400, 0.0, -0.0, 0.5, 1.5, -1.5, NAN, INF, -INF,
         1e-320, 1e308, "", "1", "abc", "false", "\x00", b"1", [1], {}, (), 1 + 0j, decimal.Decimal("NaN"))

ANY = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-5, 70_000), st.floats(), st.floats(-2, 12),
                st.text(max_size=12), st.binary(max_size=4), st.lists(st.integers(-3, 3) | st.text(max_size=2), max_size=3),
                st.dictionaries(st.text(max_size=2), st.integers(), max_size=2), st.fractions(), st.complex_numbers())


def fields(model_dir: str, a_dir: str, a_file: str, certs_dir: str, tenants_file: str = "<tenants>") -> list[Field]:
    from services.cluster.config import DecodeSettings, PrefillSettings
    from services.kvstore.config import S3Config

    count0, count1 = int_in(0), int_in(1)
    nonneg_s = real_in(0, INF, finite=False)
    s3 = S3Config(endpoint_url=None, bucket="b")
    return [
        # ---- ClusterConfig
        Field("ClusterConfig", "model_dir", is_str, (model_dir,)),
        Field("ClusterConfig", "prefill", count1, (1, 3)),
        Field("ClusterConfig", "decode", count1, (1, 3)),
        Field("ClusterConfig", "stores", count0, (0, 2)),
        Field("ClusterConfig", "device", torch_device, ("cpu", "cuda", "cuda:1")),
        Field("ClusterConfig", "dtype", engine_dtype, ("float32", "bf16")),
        Field("ClusterConfig", "kv_cache_bytes", opt(int_in(1)), (None, 1 << 20)),
        Field("ClusterConfig", "chunk_cache_bytes", opt(count0), (None, 0, 1 << 20)),
        Field("ClusterConfig", "store_dram_bytes", count1, (1 << 20,)),
        Field("ClusterConfig", "store_dir", opt(is_str), (None, a_dir)),
        Field("ClusterConfig", "gateway_port", int_in(0, 65535), (0, 65535, 50051)),
        Field("ClusterConfig", "bind_host", is_str, ("127.0.0.1", "0.0.0.0")),
        Field("ClusterConfig", "token", header_token, (None, "sesame")),
        Field("ClusterConfig", "tenants_file", lambda v: v is None or (isinstance(v, (str, os.PathLike))
              and os.path.abspath(v) == os.path.abspath(tenants_file)), (None, tenants_file), names=("tenants",)),
        Field("ClusterConfig", "tls_cert", opt(is_str), (a_file,), names=("tls-cert", "TLS"), extra={"tls_key": a_file}),
        Field("ClusterConfig", "tls_key", opt(is_str), (a_file,), names=("tls-key", "TLS"), extra={"tls_cert": a_file}),
        Field("ClusterConfig", "internal_tls", is_bool, (True, False)),
        Field("ClusterConfig", "certs_dir", opt(is_str), (None, certs_dir), names=("ca.pem",)),
        Field("ClusterConfig", "max_restarts", int_in(-1), (-1, 0, 5)),
        Field("ClusterConfig", "restart_window_s", real_in(0, INF, lo_open=True, finite=False), (1e-3, 300.0, INF)),
        Field("ClusterConfig", "text_cache_tokens", count0, (0, 8 << 20)),
        Field("ClusterConfig", "index_threads", int_in(0, 1024), (0, 4, 1024)),
        Field("ClusterConfig", "index_host_dtype", one_of("float32", "bfloat16"), ("float32", "bfloat16")),
        Field("ClusterConfig", "routing", one_of("residency", "load"), ("residency", "load")),
        Field("ClusterConfig", "store_shm", is_bool, (True, False)),
        Field("ClusterConfig", "cpu_affinity", is_bool, (True, False)),
        Field("ClusterConfig", "namespace", lambda v: isinstance(v, str) and v != "", ("tessera",)),
        Field("ClusterConfig", "detached", is_bool, (True, False)),
        Field("ClusterConfig", "gateway_on_head", is_bool, (True, False)),
        Field("ClusterConfig", "prefill_settings", lambda v: isinstance(v, PrefillSettings), (PrefillSettings(),)),
        Field("ClusterConfig", "decode_settings", lambda v: isinstance(v, DecodeSettings), (DecodeSettings(),)),
        # ---- EngineSettings
        Field("EngineSettings", "model_dir", lambda v: isinstance(v, (str, os.PathLike))
              and os.path.isfile(os.path.join(v, "config.json")), (model_dir, a_dir), names=("model directory",)),
        Field("EngineSettings", "device", torch_device, ("cpu", "cuda:0")),
        Field("EngineSettings", "dtype", engine_dtype, ("float32", "bfloat16", "fp16")),
        Field("EngineSettings", "kv_cache_bytes", opt(int_in(1)), (None, 64 << 20)),
        Field("EngineSettings", "chunk_cache_bytes", opt(count0), (None, 0, 1 << 20)),
        Field("EngineSettings", "block_size", block_size, (1, 16)),
        Field("EngineSettings", "torch_threads", count1, (1, 4)),
        Field("EngineSettings", "cpu_affinity", is_bool, (True, False)),
        Field("EngineSettings", "index_host_dtype", one_of("float32", "bfloat16"), ("float32", "bfloat16")),
        # ---- PrefillSettings
        Field("PrefillSettings", "quality_floor", real_in(0, 1), (0.0, 0.15, 1.0)),
        Field("PrefillSettings", "default_ratio", opt(real_in(0, 1)), (None, 0.0, 0.3, 1.0)),
        Field("PrefillSettings", "store_loads", one_of("cost", "always", "never"), ("cost", "always", "never")),
        Field("PrefillSettings", "handoff_transport", one_of("auto", "nixl", "grpc"), ("auto", "nixl", "grpc")),
        Field("PrefillSettings", "host_cache_bytes", count0, (0, 1 << 20)),
        Field("PrefillSettings", "nixl_slab_bytes", count0, (0, 512 << 20)),
        Field("PrefillSettings", "ipc_slab_bytes", count0, (0, 1 << 30)),
        Field("PrefillSettings", "warmup_tokens", count0, (0, 3072)),
        # ---- DecodeSettings
        Field("DecodeSettings", "max_batch", count1, (1, 32)),
        Field("DecodeSettings", "handoff_wait_s", real_in(0, INF, lo_open=True, finite=False), (0.5, 30.0)),
        Field("DecodeSettings", "store_wait_s", nonneg_s, (0.0, 1.0)),
        Field("DecodeSettings", "host_cache_bytes", count0, (0, 1 << 20)),
        Field("DecodeSettings", "nixl_slab_bytes", count0, (0, 512 << 20)),
        Field("DecodeSettings", "admit_budget_s", nonneg_s, (0.0, 0.01, INF)),
        Field("DecodeSettings", "min_step_interval_s", real_in(0, 10, hi_open=True), (0.0, 0.005, 9.9)),
        Field("DecodeSettings", "warmup_tokens", count0, (0, 4096)),
        Field("DecodeSettings", "warmup_sparse", is_bool, (True, False)),
        Field("DecodeSettings", "admit_during_step", is_bool, (False, True)),
        Field("DecodeSettings", "index_search_timeout_s", real_in(0, INF, lo_open=True), (1e-3, 10.0)),
        Field("DecodeSettings", "index_offload_timeout_s", real_in(0, INF, lo_open=True), (1e-3, 600.0)),
        # ---- SamplingParams
        Field("SamplingParams", "temperature", real_in(0, INF), (0.0, 0.7, 1e-30)),
        Field("SamplingParams", "top_p", real_in(0, 1, lo_open=True), (1.0, 0.9, 1e-30)),
        Field("SamplingParams", "top_k", count0, (0, 40)),
        # a torch generator's seed: what torch.Generator.manual_seed takes
        Field("SamplingParams", "seed", opt(int_in(-(2**63), 2**64 - 1)), (None, 0, 2**64 - 1)),
        Field("SamplingParams", "max_new_tokens", count1, (1, 32)),
        Field("SamplingParams", "stop_token_ids", stop_ids, (frozenset(), frozenset({0, 2}))),
        Field("SamplingParams", "ignore_eos", is_bool, (False, True)),
        # ---- StoreConfig
        Field("StoreConfig", "dram_bytes", count1, (1, 64 << 20)),
        Field("StoreConfig", "rocksdb_dir", lambda v: v is None or (isinstance(v, (str, os.PathLike)) and "\x00" not in str(v)
              and os.path.isdir(os.path.dirname(os.path.abspath(v)))), (None, os.path.join(a_dir, "db")), names=("rocksdb-dir",)),
        Field("StoreConfig", "rocksdb_bytes", count1, (1, 1 << 30), extra={"rocksdb_dir": os.path.join(a_dir, "db")}),
        Field("StoreConfig", "s3", lambda v: v is None or isinstance(v, S3Config), (None, s3)),
        Field("StoreConfig", "policy", one_of("lru", "s3fifo"), ("lru", "s3fifo")),
        Field("StoreConfig", "write_mode", one_of("through", "behind"), ("through", "behind")),
        Field("StoreConfig", "frame_bytes", int_in(4096, 3 << 20), (4096, 3 << 20)),
        Field("StoreConfig", "rocksdb_sync", is_bool, (True, False)),
        Field("StoreConfig", "max_chunk_bytes", count1, (1, 4 << 30)),
        Field("StoreConfig", "dram_dir", lambda v: v is None or (isinstance(v, (str, os.PathLike)) and "\x00" not in str(v)
              and os.path.isdir(os.path.dirname(os.path.abspath(v)))), (None, os.path.join(a_dir, "shm")), names=("dram_dir",)),
        Field("StoreConfig", "dram_segment_bytes", lambda v: count0(v) and (v == 0 or v >= 2 * 4096), (0, 8192, 1 << 30)),
        Field("StoreConfig", "nixl", is_bool, (False, True)),
    ]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """A model directory (config.json is all the settings look at), a plain directory, a file, a certs dir."""
    root = tmp_path_factory.mktemp("cfg")
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text("{}")
    (root / "plain").mkdir()
    (root / "file.pem").write_text("not a certificate")
    (root / "certs").mkdir()
    (root / "certs" / "ca.pem").write_text("not a certificate")
    (root / "tenants.yaml").write_text("tenants:\n  - name: acme\n    tokens: [acme-token-0123456789]\n")
    return (str(root / "model"), str(root / "plain"), str(root / "file.pem"), str(root / "certs"),
            str(root / "tenants.yaml"))


def _builder(f: Field, model_dir: str):
    from services.cluster.config import ClusterConfig, DecodeSettings, EngineSettings, PrefillSettings
    from services.engine.sampling import SamplingParams
    from services.kvstore.config import StoreConfig

    cls = {"ClusterConfig": ClusterConfig, "EngineSettings": EngineSettings, "PrefillSettings": PrefillSettings,
           "DecodeSettings": DecodeSettings, "SamplingParams": SamplingParams, "StoreConfig": StoreConfig}[f.cls]
    required = {"model_dir": model_dir} if f.cls in ("ClusterConfig", "EngineSettings") else {}
    return lambda value: cls(**{**required, **f.extra, f.name: value})


def violation(f: Field, build, value) -> str | None:
    """None when ``value`` meets the property for field ``f``, else what went wrong."""
    try:
        build(value)
    except (ValueError, FileNotFoundError) as exc:
        spellings = (f.name, f.name.replace("_", "-"), f.name.replace("_", " "), *f.names)
        if any(s in str(exc) for s in spellings):
            return None
        return f"{f.id}={value!r}: {type(exc).__name__} does not name the field: {exc}"
    except Exception as exc:  # noqa: BLE001 - any other exception type is what this test looks for
        return f"{f.id}={value!r}: {type(exc).__name__}: {exc}"
    if not f.ok(value):
        return f"{f.id}={value!r}: accepted, outside the field's domain"
    return None


def _cases():
    # the cases are built without the fixture's paths (only names and ids matter here)
    return [pytest.param(f.id, id=f.id) for f in fields("<model>", "<dir>", "<file>", "<certs>", "<tenants>")]


def test_every_field_of_every_config_is_fuzzed():
    """A field added to one of the dataclasses gets its row in ``fields`` (its domain), or this fails."""
    import dataclasses

    from services.cluster.config import ClusterConfig, DecodeSettings, EngineSettings, PrefillSettings
    from services.engine.sampling import SamplingParams
    from services.kvstore.config import StoreConfig

    have = {f.id for f in fields("<model>", "<dir>", "<file>", "<certs>")}
    every = {f"{cls.__name__}.{f.name}" for cls in (ClusterConfig, EngineSettings, PrefillSettings, DecodeSettings,
                                                     SamplingParams, StoreConfig) for f in dataclasses.fields(cls)}
    assert every - have == set(), "fields without a row in fields()"


@pytest.mark.parametrize("field_id", _cases())
def test_a_field_takes_a_value_of_its_domain_or_refuses_it_by_name(field_id, paths):
    f = next(f for f in fields(*paths) if f.id == field_id)
    build = _builder(f, paths[0])
    for value in f.good:               # the domain's own values are built
        assert violation(f, build, value) is None, violation(f, build, value)
    found = [v for v in (violation(f, build, value) for value in EDGES) if v is not None]
    expect(not found, "\n".join(found))

    @FUZZ
    @given(ANY)
    def any_value(value):
        problem = violation(f, build, value)
        assert problem is None, problem

    any_value()
