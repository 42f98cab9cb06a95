"""Tenants: two tenants sending the same document learn nothing of each other from what they receive; a
shared namespace is shared on purpose; quotas refuse what is past them, before the work they bound."""

from __future__ import annotations

import time

import pytest

from services.gateway.tenants import Quotas, Tenants
from services.sdk import (ChunkId, Client, InvalidArgument, PermissionDenied, ResourceExhausted, Shared,
                          Unauthenticated)

from tests.helpers import InProcessCluster, docs

TOKENS = {"acme": "acme-token-0123456789", "bolt": "bolt-token-0123456789", "ops": "ops-token-0123456789ab",
          "tiny": "tiny-token-0123456789", "cap": "cap-token-0123456789ab"}
TENANTS = {
    "shared": ["public"],
    "tenants": [
        {"name": "acme", "tokens": [TOKENS["acme"]], "reads": ["public"]},
        {"name": "bolt", "tokens": [TOKENS["bolt"]], "reads": ["public"]},
        {"name": "ops", "tokens": [TOKENS["ops"]], "admin": True},
        {"name": "tiny", "tokens": [TOKENS["tiny"]],
         "quotas": {"max_chunks_per_request": 4, "max_new_tokens": 8, "max_text_bytes": 4096, "max_prompt_tokens": 200}},
        {"name": "cap", "tokens": [TOKENS["cap"]], "quotas": {"max_stored_chunk_tokens": 100}},
    ],
}


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    c = InProcessCluster(tiny_model, tmp_path_factory.mktemp("tenants"), tenants=TENANTS)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def clients(cluster):
    out = {name: Client(cluster.address, token=token, timeout=60) for name, token in TOKENS.items()}
    yield out
    for c in out.values():
        c.close()


def _tiers(ev) -> dict[str, int]:
    return {k: v for k, v in ev.stats.chunk_tokens_by_tier.items() if v}


def test_the_same_document_from_two_tenants_is_two_chunks(clients, reference):
    """bolt sending acme's document computes it (no hit, other ids, the same tokens): nothing it receives
    tells that acme sent it. acme's own repeat is a hit."""
    doc, suffix = docs(1, 64, seed=41), [9, 10]
    want = reference.generate(doc, suffix, max_new_tokens=6, stop_token_ids=[])
    a1 = clients["acme"].complete(doc, suffix, max_new_tokens=6, stop_token_ids=[])
    a2 = clients["acme"].complete(doc, suffix, max_new_tokens=6, stop_token_ids=[])
    b1 = clients["bolt"].complete(doc, suffix, max_new_tokens=6, stop_token_ids=[])
    assert list(a1.token_ids) == list(a2.token_ids) == list(b1.token_ids) == want
    assert _tiers(a1) == {"computed": 64} and _tiers(a2) == {"gpu": 64}
    assert _tiers(b1) == _tiers(a1)                 # what bolt sees is what the first sender saw
    assert set(b1.stats.chunk_ids).isdisjoint(a1.stats.chunk_ids)
    assert reference.chunk_id(doc[0]) not in set(a1.stats.chunk_ids) | set(b1.stats.chunk_ids)


def test_a_registered_id_is_unknown_to_other_tenants(clients):
    reg = clients["acme"].register_chunks([docs(1, 24, seed=42)[0]])
    cid = reg[0].chunk_id
    clients["acme"].complete([ChunkId(cid)], [1], max_new_tokens=2, stop_token_ids=[])
    with pytest.raises(InvalidArgument) as other:
        clients["bolt"].complete([ChunkId(cid)], [1], max_new_tokens=2)
    with pytest.raises(InvalidArgument) as never:
        clients["bolt"].complete([ChunkId("f" * 64)], [1], max_new_tokens=2)
    # the same answer as for an id never registered, but for the id itself
    assert str(other.value.details).replace(cid, "X") == str(never.value.details).replace("f" * 64, "X")


def test_a_shared_namespace_is_one_copy_for_the_tenants_that_read_it(clients):
    doc = docs(1, 48, seed=43)[0]
    a = clients["acme"].complete([Shared(doc, "public")], [3], max_new_tokens=2, stop_token_ids=[])
    b = clients["bolt"].complete([Shared(doc, "public")], [3], max_new_tokens=2, stop_token_ids=[])
    assert _tiers(a) == {"computed": 48} and _tiers(b) == {"gpu": 48}
    assert list(a.stats.chunk_ids) == list(b.stats.chunk_ids)
    with pytest.raises(PermissionDenied, match="may not use namespace 'public'"):
        clients["tiny"].complete([Shared(doc, "public")], [3], max_new_tokens=2)
    with pytest.raises(PermissionDenied):
        clients["acme"].complete([Shared(doc, "tenant/bolt")], [3], max_new_tokens=2)


def test_stats_are_the_callers_own(clients):
    acme = clients["acme"].stats()
    assert acme.tenant == "acme" and acme.workers == () and acme.metrics_url == ""
    ops = clients["ops"].stats()
    assert ops.tenant == "ops" and {w.role for w in ops.workers} == {"prefill", "decode"}
    assert ops.requests_total >= acme.requests_total
    before = clients["tiny"].stats()
    clients["acme"].complete(docs(1, 8, seed=49), [1], max_new_tokens=1)
    clients["acme"].register_chunks([docs(1, 8, seed=50)[0]])
    after = clients["tiny"].stats()                 # another tenant's requests and chunks show nowhere
    assert (after.requests_total, after.registered_chunks) == (before.requests_total, before.registered_chunks) == (
        before.requests_total, 0)


def test_reset_caches_drops_only_the_callers_chunks(clients):
    a_doc, b_doc = docs(1, 32, seed=44), docs(1, 32, seed=45)
    for name, doc in (("acme", a_doc), ("bolt", b_doc)):
        clients[name].complete(doc, [2], max_new_tokens=2, stop_token_ids=[])
    assert clients["bolt"].reset_caches(device_only=True) >= 1
    a = clients["acme"].complete(a_doc, [2], max_new_tokens=2, stop_token_ids=[])
    b = clients["bolt"].complete(b_doc, [2], max_new_tokens=2, stop_token_ids=[])
    assert _tiers(a) == {"gpu": 32}                     # acme's chunk survived bolt's reset
    assert "gpu" not in _tiers(b)                       # bolt's did not


def test_quotas_refuse_with_the_quota_named(clients):
    tiny = clients["tiny"]
    with pytest.raises(ResourceExhausted, match="max_chunks_per_request"):
        tiny.complete(docs(5, 4, seed=46), [1], max_new_tokens=2)
    with pytest.raises(ResourceExhausted, match="max_new_tokens"):
        tiny.complete(docs(1, 4, seed=47), [1], max_new_tokens=9)
    with pytest.raises(ResourceExhausted, match="max_prompt_tokens"):
        tiny.complete(docs(2, 120, seed=48), [1], max_new_tokens=2)
    t0 = time.perf_counter()
    with pytest.raises(ResourceExhausted, match="max_text_bytes"):
        tiny.complete(["x" * 4097], [1], max_new_tokens=2)
    big = "word " * 1_200_000                            # 6 MB: refused before any of it is tokenized
    with pytest.raises(InvalidArgument, match="cannot fit the model's limit"):
        clients["acme"].complete([big], [1], max_new_tokens=2)
    assert time.perf_counter() - t0 < 5.0
    ok = tiny.complete(docs(1, 4, seed=47), [1], max_new_tokens=8, stop_token_ids=[])
    assert len(ok.token_ids) == 8


def test_an_unknown_token_is_refused(cluster):
    with Client(cluster.address, token="not-a-tenant-token-123", timeout=10) as c:
        with pytest.raises(Unauthenticated):
            c.stats()


@pytest.mark.parametrize("raw, reason", [
    ({}, "non-empty list under 'tenants'"),
    ({"tenants": [{"name": "A", "tokens": ["x" * 16]}]}, "name must match"),
    ({"tenants": [{"name": "a", "tokens": ["short"]}]}, "at least 16 characters"),
    ({"tenants": [{"name": "a", "tokens": ["x" * 16], "reads": ["public"]}]}, "which 'shared' does not declare"),
    ({"tenants": [{"name": "a", "tokens": ["x" * 16]}, {"name": "b", "tokens": ["x" * 16]}]}, "also another tenant's"),
    ({"tenants": [{"name": "a", "tokens": ["x" * 16], "quotas": {"max_in_flight": 0}}]}, "max_in_flight must be"),
    ({"tenants": [{"name": "a", "tokens": ["x" * 16], "quotas": {"bogus": 1}}]}, "unknown quota 'bogus'"),
    ({"tenants": [{"name": "a", "tokens": ["x" * 16], "admin": "yes"}]}, "'admin' must be true or false"),
])
def test_a_bad_tenants_file_is_refused_with_the_reason(raw, reason):
    with pytest.raises(ValueError, match=reason):
        Tenants.parse(raw)


def test_quotas_default_and_validate():
    assert Quotas().max_chunks_per_request == 256
    with pytest.raises(ValueError, match="max_chunks_per_request"):
        Quotas(max_chunks_per_request=True)


@pytest.mark.parametrize("mode", ["prefix", "position_aware", "blend_copy"])
def test_no_mode_shares_a_chunk_across_tenants(clients, mode):
    doc = docs(2, 40, seed=60 + ["prefix", "position_aware", "blend_copy"].index(mode))
    a1 = clients["acme"].complete(doc, [4], max_new_tokens=2, stop_token_ids=[], mode=mode)
    a2 = clients["acme"].complete(doc, [4], max_new_tokens=2, stop_token_ids=[], mode=mode)
    b1 = clients["bolt"].complete(doc, [4], max_new_tokens=2, stop_token_ids=[], mode=mode)
    assert "gpu" in _tiers(a2) and "gpu" not in _tiers(a1)
    assert _tiers(b1) == _tiers(a1)


def test_an_unset_max_new_tokens_is_the_quota_when_that_is_lower(cluster):
    """max_new_tokens left unset reads as 16: a tenant whose quota is 8 was refused a request that named none."""
    import grpc

    from services.rpc import tessera_pb2 as pb
    from services.rpc import tessera_pb2_grpc as pb_grpc

    req = pb.GenerateRequest(chunks=[pb.ChunkInput(tokens=pb.TokenIds(ids=docs(1, 4, seed=51)[0]))],
                             suffix_tokens=pb.TokenIds(ids=[1]), sampling=pb.SamplingParams(ignore_eos=True))
    with grpc.insecure_channel(cluster.address) as ch:
        replies = list(pb_grpc.TesseraStub(ch).Generate(req, metadata=[("authorization", f"Bearer {TOKENS['tiny']}")],
                                                        timeout=60))
    assert sum(len(r.token_ids) for r in replies) == 8 and replies[-1].finish_reason == "length"


def test_a_tenants_stored_chunks_are_bounded_until_it_drops_them(clients):
    cap = clients["cap"]
    first, second = docs(1, 64, seed=81), docs(1, 64, seed=82)
    cap.complete(first, [1], max_new_tokens=1)
    cap.complete(first, [2], max_new_tokens=1)                       # the same chunk again: nothing new kept
    with pytest.raises(ResourceExhausted, match="max_stored_chunk_tokens"):
        cap.complete(second, [1], max_new_tokens=1)                  # 64 + 64 > 100
    with pytest.raises(ResourceExhausted, match="max_stored_chunk_tokens"):
        cap.register_chunks([second[0]])
    assert cap.reset_caches() >= 1                                   # its chunks dropped: room again
    assert len(cap.complete(second, [1], max_new_tokens=1, stop_token_ids=[]).token_ids) == 1


def test_a_bad_tenants_file_starts_nothing(tiny_model, tmp_path):
    """The launchers check the file before starting anything (ClusterConfig only checks that it exists)."""
    from services.launch.plan import checked_tenants
    from services.cluster.config import ClusterConfig

    bad = tmp_path / "tenants.yaml"
    bad.write_text("tenants:\n  - name: acme\n    tokens: [short]\n")
    with pytest.raises(ValueError, match=f"{bad}: tenant acme: every token needs at least 16"):
        checked_tenants(ClusterConfig(model_dir=tiny_model, tenants_file=str(bad)))
    with pytest.raises(FileNotFoundError, match="tenants file"):
        ClusterConfig(model_dir=tiny_model, tenants_file=str(tmp_path / "absent.yaml"))
    good = tmp_path / "good.yaml"
    good.write_text("tenants:\n  - name: acme\n    tokens: [acme-token-0123456789]\n")
    assert checked_tenants(ClusterConfig(model_dir=tiny_model, tenants_file=str(good)))["tenants"][0]["name"] == "acme"
