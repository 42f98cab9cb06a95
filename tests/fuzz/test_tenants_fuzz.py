"""Fuzzing tenants: the tenants file (services/gateway/tenants.py, read by ClusterConfig.tenants_file) and the
client API of a cluster serving several tenants.

The file: documents built from a valid one and damaged (keys dropped or set to random YAML values, written as
YAML, as JSON, or as raw text and bytes). Property: ``Tenants.from_file`` reads it into tenants whose names,
tokens and namespaces keep the file's rules, or refuses it with a ValueError / FileNotFoundError whose message
names the file; never another exception type.

The cluster (``InProcessCluster`` with a tenants file): requests of random tenants (and of no one) naming each
other's chunk ids, namespaces shared or not, past their quotas. Property: a clear status; a tenant is served a
chunk id only when it was registered in a namespace that tenant may read, and another tenant's id is refused
exactly as one never registered (its existence is not leaked); the workers still serve afterwards.
"""

from __future__ import annotations

import json
import re

import grpc
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from services.rpc import tessera_pb2 as pb
from services.rpc import tessera_pb2_grpc as pb_grpc

from .common import FUZZ, expect, leaked_traceback

NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")      # the file's rule for tenant and namespace names (fullmatch)
TOKENS = {"acme": "acme-token-0123456789", "globex": "globex-token-0123456789", "ops": "ops-token-0123456789ab"}
GOOD = {
    "shared": ["public"],
    "tenants": [
        {"name": "acme", "tokens": [TOKENS["acme"]], "reads": ["public"],
         "quotas": {"max_chunks_per_request": 3, "max_prompt_tokens": 300, "max_new_tokens": 8, "max_text_bytes": 2000}},
        {"name": "globex", "tokens": [TOKENS["globex"]]},
        {"name": "ops", "tokens": [TOKENS["ops"]], "admin": True},
    ],
}


# ---------------------------------------------------------------------------------------------- the file
YAML_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-2, 10), st.floats(allow_nan=False),
                         st.text(max_size=20), st.sampled_from(["public", "acme", "x" * 16, "", "-1"]))
YAML_VALUES = st.recursive(YAML_SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6) | st.sampled_from(["name", "tokens", "max_new_tokens"]),
                                             inner, max_size=3), max_leaves=8)
TENANT_KEYS = ["name", "tokens", "reads", "admin", "quotas", "extra"]
QUOTA_KEYS = ["max_chunks_per_request", "max_chunk_tokens", "max_prompt_tokens", "max_new_tokens", "max_in_flight",
              "max_text_bytes", "max_other"]


@st.composite
def tenants_document(draw):
    """GOOD with a few of its parts dropped or set to random values."""
    doc = json.loads(json.dumps(GOOD))
    for _ in range(draw(st.integers(0, 3))):
        where = draw(st.sampled_from(["top", "tenant", "quotas", "tenants"]))
        value = draw(YAML_VALUES)
        if where == "top":
            key = draw(st.sampled_from(["shared", "tenants", "other"]))
        elif where == "tenants":
            doc["tenants"] = value if draw(st.booleans()) else [*doc.get("tenants", []), value] if isinstance(
                doc.get("tenants"), list) else value
            continue
        if where == "top":
            target = doc
        else:
            tenants = doc.get("tenants")
            if not isinstance(tenants, list) or not tenants or not isinstance(tenants[0], dict):
                continue
            target = tenants[draw(st.integers(0, len(tenants) - 1))]
            if not isinstance(target, dict):
                continue
            key = draw(st.sampled_from(TENANT_KEYS))
            if where == "quotas":
                if not isinstance(target.get("quotas"), dict):
                    target["quotas"] = {}
                target, key = target["quotas"], draw(st.sampled_from(QUOTA_KEYS))
        if draw(st.integers(0, 3)) == 0:
            target.pop(key, None)
        else:
            target[key] = value
    return doc


def file_text(draw_doc, how: str) -> bytes:
    if how == "json":
        return json.dumps(draw_doc).encode()
    return yaml.safe_dump(draw_doc, allow_unicode=True).encode()


def check_file(path, data: bytes) -> None:
    from services.gateway.tenants import Tenants

    path.write_bytes(data)
    try:
        tenants = Tenants.from_file(path)
    except (ValueError, FileNotFoundError) as exc:
        assert str(path) in str(exc), f"the refusal does not name the file: {type(exc).__name__}: {exc}"
        return
    except Exception as exc:  # noqa: BLE001 - any other type is the defect looked for
        pytest.fail(f"{type(exc).__name__} reading {data!r:.400}: {exc}")
    assert tenants.by_name, "a tenants file read without a tenant"
    assert all(NAME.fullmatch(s) for s in tenants.shared), tenants.shared
    for name, tenant in tenants.by_name.items():
        assert NAME.fullmatch(name), f"tenant name {name!r} read"
        assert tenant.reads <= tenants.shared and isinstance(tenant.admin, bool)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("tenants")


@pytest.mark.slow
def test_a_tenants_file_is_read_or_refused_by_name(folder):
    @settings(FUZZ, max_examples=200)
    @given(tenants_document(), st.sampled_from(["yaml", "json"]))
    def read(doc, how):
        check_file(folder / f"tenants.{how}", file_text(doc, how))

    read()


def test_a_tenants_file_of_random_text_is_read_or_refused_by_name(folder):
    @settings(FUZZ, max_examples=150)
    @given(st.text(max_size=200).map(str.encode) | st.sampled_from([b"", b"[]", b"tenants:", b"tenants: []", b"- a",
                                                                      b"!!python/object:os.system x", b"{a: [", b"\t"]),
           st.sampled_from(["yaml", "json"]))
    def read(data, how):
        check_file(folder / f"tenants.{how}", data)

    read()


def test_cluster_config_reads_its_tenants_file_or_refuses_it_by_name(folder, tmp_path):
    from services.cluster.config import ClusterConfig

    (tmp_path / "config.json").write_text("{}")

    @settings(FUZZ, max_examples=60)
    @given(tenants_document())
    def build(doc):
        path = folder / "cluster-tenants.yaml"
        path.write_bytes(file_text(doc, "yaml"))
        try:
            ClusterConfig(model_dir=str(tmp_path), tenants_file=str(path))
        except (ValueError, FileNotFoundError) as exc:
            assert str(path) in str(exc) or "tenants" in str(exc), exc
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"{type(exc).__name__}: {exc}")

    build()


def _refused_by_name(path, text: bytes) -> None:
    from services.gateway.tenants import Tenants

    path.write_bytes(text)
    try:
        Tenants.from_file(path)
    except (ValueError, FileNotFoundError) as exc:
        expect(str(path) in str(exc), f"refused, but the message does not name the file: {type(exc).__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001 - the defect
        expect(False, f"{type(exc).__name__}: {exc}")
    else:
        expect(False, f"read: {text!r}")


ACME = f"tenants:\n  - name: acme\n    tokens: [{TOKENS['acme']}]\n"


@pytest.mark.parametrize("quotas", ["5", "[1]", "abc"])
def test_quotas_that_are_not_a_mapping_are_refused_by_name(folder, quotas):
    _refused_by_name(folder / "quotas.yaml", f"{ACME}    quotas: {quotas}\n".encode())


@pytest.mark.parametrize("where", ["top", "tenant", "quotas"])
def test_unknown_keys_of_two_types_are_refused_by_name(folder, where):
    text = {"top": f"1: 2\nx: 3\n{ACME}", "tenant": f"{ACME}    1: 2\n    x: 3\n",
            "quotas": f"{ACME}    quotas: {{1: 2, x: 3}}\n"}[where]
    _refused_by_name(folder / "keys.yaml", text.encode())


def test_a_tenants_file_that_is_not_utf8_is_refused_by_name(folder):
    _refused_by_name(folder / "binary.yaml", b"\xff\xfe tenants")


def test_a_token_listed_twice_by_one_tenant_is_refused_by_name(folder):
    _refused_by_name(folder / "twice.yaml", f"tenants:\n  - name: acme\n    tokens: [{TOKENS['acme']}, "
                                           f"{TOKENS['acme']}]\n".encode())


def test_a_name_with_a_trailing_newline_is_refused(folder):
    _refused_by_name(folder / "newline.json", json.dumps(
        {"tenants": [{"name": "acme\n", "tokens": [TOKENS["acme"]]}]}).encode())


# ---------------------------------------------------------------------------------------------- the cluster
@pytest.fixture(scope="module")
def tenant_cluster(tiny_model, tmp_path_factory):
    from tests.helpers import InProcessCluster

    c = InProcessCluster(tiny_model, tmp_path_factory.mktemp("tenants-rocksdb"), tenants=GOOD)
    yield c
    c.stop()


CLEAR = {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAUTHENTICATED", "PERMISSION_DENIED", "NOT_FOUND",
         "DEADLINE_EXCEEDED"}
FIXED = pb.GenerateRequest(chunks=[pb.ChunkInput(tokens=pb.TokenIds(ids=[1, 2, 3, 4]))],
                           suffix_tokens=pb.TokenIds(ids=[5, 6]), sampling=pb.SamplingParams(max_new_tokens=8))


def md(tenant: str | None):
    return (("authorization", f"Bearer {TOKENS[tenant]}"),) if tenant else ()


class TenantApi:
    """A stub of the tenants' gateway, and chunk ids each tenant registered: (tenant, namespace) -> id."""

    def __init__(self, cluster) -> None:
        self.channel = grpc.insecure_channel(cluster.address)
        self.stub = pb_grpc.TesseraStub(self.channel)
        doc = [7, 8, 9, 10, 11, 12]
        self.ids = {}
        for tenant, namespace in (("acme", ""), ("acme", "public"), ("globex", ""), ("ops", "")):
            reply = self.stub.RegisterChunks(pb.RegisterChunksRequest(chunks=[pb.ChunkInput(
                tokens=pb.TokenIds(ids=doc), namespace=namespace)]), metadata=md(tenant), timeout=60)
            self.ids[tenant, namespace] = reply.chunks[0].chunk_id
        self.baseline = self.fixed("globex")

    def fixed(self, tenant: str) -> list[int]:
        return [t for m in self.stub.Generate(FIXED, metadata=md(tenant), timeout=60) for t in m.token_ids]

    def generate(self, req, tenant):
        try:
            return "OK", "", [m for m in self.stub.Generate(req, metadata=md(tenant), timeout=60)]
        except grpc.RpcError as exc:
            return exc.code().name, exc.details() or "", []


@pytest.fixture(scope="module")
def tapi(tenant_cluster):
    a = TenantApi(tenant_cluster)
    yield a
    a.channel.close()


def may_use(tenant: str, owner: tuple[str, str]) -> bool:
    """Whether ``tenant`` may be served a chunk ``owner`` (tenant, namespace) registered."""
    who, namespace = owner
    return (who == tenant and not namespace) or (namespace == "public" and tenant == "acme")


@pytest.mark.slow
def test_the_same_document_has_one_id_per_namespace(tapi):
    """Tenants never share an id for their own chunks; the shared namespace is its own id."""
    assert len(set(tapi.ids.values())) == len(tapi.ids), tapi.ids


@pytest.mark.slow
def test_a_tenant_is_served_only_the_chunks_it_may_read(tapi):
    owners = sorted(tapi.ids)
    own_tokens = st.builds(lambda ids: ("tokens", "", ids), st.lists(st.integers(0, 319), min_size=1, max_size=30))
    chunk = st.one_of(own_tokens, own_tokens, st.builds(lambda o: ("id", o), st.sampled_from(owners)),
                      st.builds(lambda o: ("id", o), st.sampled_from(owners)),
                      st.builds(lambda t: ("random-id", t), st.text(max_size=64)),
                      st.builds(lambda ns, ids: ("tokens", ns, ids),
                                st.sampled_from(["public", "private", "tenant/acme", "shared/public"])
                                | st.text(max_size=10), st.lists(st.integers(0, 319), min_size=1, max_size=30)))

    def to_input(c):
        if c[0] == "id":
            return pb.ChunkInput(chunk_id=tapi.ids[c[1]])
        if c[0] == "random-id":
            return pb.ChunkInput(chunk_id=c[1])
        return pb.ChunkInput(tokens=pb.TokenIds(ids=c[2]), namespace=c[1])

    @settings(FUZZ, max_examples=120)
    @given(st.sampled_from(["acme", "globex", "ops", "acme", "globex", None]), st.lists(chunk, min_size=1, max_size=4),
           st.integers(1, 8) | st.sampled_from([0, 9, 12]))
    def call(tenant, chunks, n):
        req = pb.GenerateRequest(chunks=[to_input(c) for c in chunks], suffix_tokens=pb.TokenIds(ids=[3]),
                                 sampling=pb.SamplingParams(max_new_tokens=n))
        code, details, messages = tapi.generate(req, tenant)
        assert code in CLEAR, f"{code} ({details}) for {tenant}: {chunks}"
        assert leaked_traceback(details, *[c[1] for c in chunks if isinstance(c[1], str)]) is None, details
        if tenant is None:
            assert code == "UNAUTHENTICATED", f"no token, {code}: {details}"
            return
        foreign = [c[1] for c in chunks if c[0] == "id" and not may_use(tenant, c[1])]
        if foreign:
            assert code != "OK", f"tenant {tenant} was served {foreign}'s chunk"
            for owner in foreign:
                cid = tapi.ids[owner]
                if cid in details:       # worded as for an id never registered: nothing tells the id exists
                    assert re.fullmatch(rf"unknown chunk id '{cid}' in chunk \d: register it with RegisterChunks first",
                                        details), details
        if code == "OK":
            stats = messages[-1].stats
            assert not set(stats.chunk_ids) & {tapi.ids[o] for o in owners if not may_use(tenant, o)}

    call()
    assert tapi.fixed("globex") == tapi.baseline


@pytest.mark.slow
def test_stats_and_reset_caches_show_a_tenant_its_own(tapi):
    @settings(FUZZ, max_examples=16)
    @given(st.sampled_from(["acme", "globex", "ops"]), st.booleans())
    def call(tenant, device_only):
        stats = tapi.stub.Stats(pb.StatsRequest(), metadata=md(tenant), timeout=60)
        assert stats.tenant == tenant
        assert bool(stats.workers) == (tenant == "ops"), f"{tenant} sees {len(stats.workers)} workers"
        try:
            tapi.stub.ResetCaches(pb.ResetCachesRequest(device_only=device_only), metadata=md(tenant), timeout=60)
        except grpc.RpcError as exc:
            assert exc.code().name in CLEAR and leaked_traceback(exc.details() or "") is None, exc

    call()
    assert tapi.fixed("globex") == tapi.baseline
