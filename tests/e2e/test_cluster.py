"""The cluster on Ray: outputs equal the engine's, concurrency, chunk-aware routing, replay."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from services.sdk import Client

from tests.helpers import docs, start_ray_cluster

pytestmark = pytest.mark.slow

MODES = ("full", "prefix", "position_aware", "blend_copy", "tessera")


@pytest.fixture(scope="module")
def cluster(local_ray, tiny_model, tmp_path_factory):
    c = start_ray_cluster(tiny_model, tmp_path_factory.mktemp("rocksdb"), "tessera-test-serve", prefill=2, decode=1)
    yield c
    c.stop()
    from ray.util.placement_group import placement_group_table       # the decode worker's group went with it

    assert [g["name"] for g in placement_group_table().values()
            if g["name"].startswith("tessera/tessera-test-serve/") and g["state"] != "REMOVED"] == []


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.gateway_address, timeout=120) as c:
        yield c


@pytest.mark.parametrize("mode", MODES)
def test_greedy_output_equals_engine_generate(client, reference, mode):
    chunks, suffix = docs(3, 40, seed=10), [11, 12, 13]
    for _ in range(2):  # cold, then with the chunks cached where the mode caches them
        got = client.complete(chunks, suffix, max_new_tokens=10, mode=mode, recompute_ratio=0.15, stop_token_ids=[])
        assert list(got.token_ids) == reference.generate(chunks, suffix, max_new_tokens=10, mode=mode,
                                                         recompute_ratio=0.15, stop_token_ids=[])
        assert sum(got.stats.chunk_tokens_by_tier.values()) == 120


def test_default_stop_is_the_model_eos(client, reference):
    chunks, suffix = docs(1, 30, seed=11), [2]
    got = client.complete(chunks, suffix, max_new_tokens=40, recompute_ratio=0.15)
    assert list(got.token_ids) == reference.generate(chunks, suffix, max_new_tokens=40, recompute_ratio=0.15)


def test_fifty_concurrent_requests_complete(client, reference):
    pool = docs(6, 32, seed=12)
    requests = [([pool[i % 6], pool[(i * 5 + 1) % 6]], [i % 250 + 1, 7]) for i in range(50)]

    def run(req):
        # a fixed ratio: the loading controller would follow measured load times (two prefill
        # workers: one streams from the store what the other computed)
        return client.complete(req[0], req[1], max_new_tokens=6, recompute_ratio=0.15, stop_token_ids=[])

    with ThreadPoolExecutor(50) as ex:
        results = list(ex.map(run, requests))
    assert len(results) == 50
    for (chunks, suffix), got in zip(requests, results):
        assert got.finish_reason == "length"
        want = reference.generate(chunks, suffix, max_new_tokens=6, recompute_ratio=0.15, stop_token_ids=[])
        assert list(got.token_ids) == want, got.stats
    tiers = {}
    for got in results:
        for tier, n in got.stats.chunk_tokens_by_tier.items():
            tiers[tier] = tiers.get(tier, 0) + n
    assert tiers.get("gpu", 0) > 0, f"six documents over 50 requests must be reused: {tiers}"
    # continuous batching: some decode steps carried several sequences at once
    import urllib.request

    decode = next(w for w in client.stats().workers if w.role == "decode")
    text = urllib.request.urlopen(decode.metrics_url, timeout=10).read().decode()
    value = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln.startswith("tessera_decode_batch_size")}
    assert value['tessera_decode_batch_size_bucket{le="1.0"}'] < value["tessera_decode_batch_size_count"]


def test_router_sends_a_request_where_its_chunks_are(client):
    chunks = docs(2, 64, seed=13)
    first = client.complete(chunks, [1], max_new_tokens=2, stop_token_ids=[])
    assert first.stats.chunk_tokens_by_tier == {"computed": 128}
    for suffix in ([2], [3], [4]):
        again = client.complete(chunks[::-1], suffix, max_new_tokens=2, stop_token_ids=[])
        assert again.stats.prefill_worker == first.stats.prefill_worker
        assert again.stats.chunk_tokens_by_tier == {"gpu": 128}


def test_actors_are_placed_with_their_resources(cluster, local_ray):
    from services.launch.on_ray import find_actors

    ray = local_ray
    assert set(find_actors("tessera-test-serve")) == set(cluster.actors)
    assert all(ray.get(h.ping.remote(), timeout=30) == "ok" for h in cluster.actors.values())
    # each worker holds one CPU (a GPU too on CUDA); stores, index services and the gateway hold none
    held = ray.cluster_resources()["CPU"] - ray.available_resources().get("CPU", 0.0)
    assert held == 3
    # the decode worker's index service runs on its node, in its placement group
    assert cluster.names["index"] == ["tessera-index-0"]
    nodes = ray.get([cluster.actors[n].node.remote() for n in ("tessera-decode-0", "tessera-index-0")], timeout=30)
    assert nodes[0] is not None and nodes[0] == nodes[1]
    from ray.util.placement_group import placement_group_table

    groups = [g for g in placement_group_table().values() if g["name"] == "tessera/tessera-test-serve/tessera-decode-0"]
    assert [(g["state"], g["bundles_to_node_id"][0]) for g in groups] == [("CREATED", nodes[0])]
    st = Client(cluster.gateway_address).stats()
    assert len(st.workers) == 3 and all(w.healthy for w in st.workers)
    # every actor, store shard and gateway included, serves Prometheus metrics of its own
    import urllib.request

    prefixes = {"gateway": "tessera_gateway_", "prefill": "tessera_prefill_", "decode": "tessera_decode_",
                "store": "tessera_kvstore_", "index": "tessera_index_"}
    assert set(cluster.metrics) == set(cluster.actors)
    for name, url in cluster.metrics.items():
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        assert next(p for role, p in prefixes.items() if role in name) in text, name


def test_replay_through_the_sdk_reports_tiers(cluster):
    from loadgen.replay import ReplayConfig, replay_modes
    from loadgen.trace import LengthDist, SynthConfig, synthesize
    from loadgen.replay.cluster_target import ClusterTarget

    trace = synthesize(SynthConfig(docs=4, alpha=1.1, chunks_per_request=2, doc_tokens=LengthDist("const", (24.0,)),
                                   suffix_tokens=LengthDist("const", (4.0,)), output_tokens=LengthDist("const", (3.0,)),
                                   rate=float("inf"), requests=8, seed=1))
    target = ClusterTarget(cluster.gateway_address)
    runs, summaries = replay_modes(trace, target, ReplayConfig(concurrency=2, vocab_size=256), ["full", "tessera"],
                                   progress=False)
    for run in runs:
        assert all(r.ok for r in run.records), [r.error for r in run.records if not r.ok]
        assert all(r.output_tokens == 3 and sum(r.tier_tokens.values()) == r.chunk_tokens for r in run.records)
    assert summaries[0].tier_hit_ratios == {"computed": 1.0}
    assert summaries[1].hit_ratio > 0


def test_tessera_replay_cli_against_the_cluster(cluster, tmp_path, capsys):
    """`tessera replay --target ADDR --compare ...` drives the running cluster and writes the report."""
    import json

    from loadgen.trace import LengthDist, SynthConfig, synthesize, write_trace
    from services.cli import main

    trace = synthesize(SynthConfig(docs=4, alpha=1.1, chunks_per_request=2, doc_tokens=LengthDist("const", (20.0,)),
                                   suffix_tokens=LengthDist("const", (3.0,)), output_tokens=LengthDist("const", (2.0,)),
                                   rate=float("inf"), requests=6, seed=2))
    write_trace(tmp_path / "t.jsonl", trace)
    out = tmp_path / "out"
    rc = main(["replay", str(tmp_path / "t.jsonl"), "--target", cluster.gateway_address, "--compare", "full,tessera",
               "--concurrency", "2", "-o", str(out)])
    assert rc == 0
    assert "| metric | full | tessera |" in capsys.readouterr().out
    assert {"full", "tessera", "summary.md", "summary.json", "ttft_cdf.png", "hit_ratio_over_time.png"} <= \
        {p.name for p in out.iterdir()}
    summary = json.loads((out / "summary.json").read_text())
    assert "--target" in summary["command"]
    lines = (out / "tessera" / "requests.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines]
    assert len(records) == 6 and all(r["error"] is None and r["output_tokens"] == 2 for r in records)
    assert sum(r["tier_tokens"].get("gpu", 0) for r in records) > 0  # later requests reuse chunks
