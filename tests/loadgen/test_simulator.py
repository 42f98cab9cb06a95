"""The cache simulator: the closed form, compulsory misses, policy order, evictions, the CLI."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from collections import Counter

import pytest

from loadgen.sim import POLICIES, ModelShape, SimConfig, closed_form_ratio, parse_bytes, simulate
from loadgen.sim.caches import EVICTIONS, make_cache
from loadgen.sim.sweep import SweepConfig, run_sweep, sweep_table
from loadgen.trace import Chunk, LengthDist, SynthConfig, TraceRequest, parse_lines, synthesize, write_trace
from services.cli import main

SHAPE = ModelShape.from_name("llama3-8b")
DOC_TOKENS = 16


def _trace(alpha=1.0, k=20, requests=5000, docs=2000, replace=True, doc_tokens="const:16", seed=0):
    return synthesize(SynthConfig(docs=docs, alpha=alpha, chunks_per_request=k, requests=requests,
                                  with_replacement=replace, doc_tokens=LengthDist.parse(doc_tokens),
                                  seed=seed))


def test_closed_form_value():
    assert closed_form_ratio(100, 20, 1.0) == pytest.approx(2.27, abs=0.005)
    assert closed_form_ratio(100, 20, 0.85) == pytest.approx(2.86, abs=0.02)   # the paper's figure


@pytest.mark.slow
def test_oracles_match_the_closed_form():
    # D = K = 20 positions, C = 100 documents of budget, alpha = 1: H_100 / H_5 = 2.27.
    trace = _trace()
    budget = 100 * DOC_TOKENS * SHAPE.kv_bytes_per_token
    agn = simulate(trace, SimConfig("oracle_static_agnostic", budget, SHAPE))
    awa = simulate(trace, SimConfig("oracle_static_aware", budget, SHAPE))
    assert agn.insertions == 100 and awa.insertions == 5 * 20
    h = lambda n: math.fsum(i ** -1.0 for i in range(1, n + 1))  # noqa: E731
    # Each hit ratio within 4 standard errors of the Zipf mass it holds (100k draws).
    for got, want in ((agn.hit_ratio, h(100) / h(2000)), (awa.hit_ratio, h(5) / h(2000))):
        assert abs(got - want) < 4 * math.sqrt(want * (1 - want) / agn.chunk_accesses)
    assert agn.hit_ratio / awa.hit_ratio == pytest.approx(closed_form_ratio(100, 20, 1.0), rel=0.03)


def _prefix_chained(requests=400, seed=0):
    """Mooncake-shaped: request i's blocks are a prefix of one long document, so block b is
    always at position b (the last block whole: 512 tokens, plus one private token)."""
    rnd = random.Random(seed)
    lines = []
    for i in range(requests):
        n = min(int(rnd.paretovariate(1.2)), 30)
        lines.append(json.dumps({"timestamp": i, "input_length": 512 * n + 1, "output_length": 1,
                                 "hash_ids": list(range(n)) + [1000 + i]}))
    return parse_lines(lines)


def test_the_aware_oracle_pays_only_for_positions_the_trace_has():
    trace = _prefix_chained()
    budget = 8 * 512 * SHAPE.kv_bytes_per_token
    agn = simulate(trace, SimConfig("oracle_static_agnostic", budget, SHAPE))
    awa = simulate(trace, SimConfig("oracle_static_aware", budget, SHAPE))
    assert agn.insertions == awa.insertions == 8 and awa.inserted_bytes == budget
    assert awa.hit_tokens == agn.hit_tokens > 0


@pytest.mark.parametrize("oracle,dynamic", [("oracle_static_agnostic", "tessera"),
                                            ("oracle_static_aware", "position_aware")])
def test_oracles_miss_each_key_once_like_an_unlimited_cache(oracle, dynamic):
    trace = _trace(alpha=1.2, k=5, requests=1500, docs=300, replace=False, doc_tokens="uniform:8:64")
    got = simulate(trace, SimConfig(oracle, math.inf, SHAPE))
    want = simulate(trace, SimConfig(dynamic, math.inf, SHAPE))
    assert got.hit_tokens == want.hit_tokens < got.chunk_tokens
    assert got.insertions == want.insertions
    # Every chunk used once: every use is a first use, and no cache can hit.
    unique = [TraceRequest(r.timestamp_ms, r.input_length, 1, r.hash_ids,
                           tuple(Chunk(1000 * i + j, c.tokens) for j, c in enumerate(r.chunks)),
                           r.suffix_tokens) for i, r in enumerate(trace[:50])]
    assert simulate(unique, SimConfig(oracle, math.inf, SHAPE)).hit_tokens == 0


@pytest.mark.parametrize("policy", ["prefix", "position_aware", "tessera"])
def test_unlimited_budget_misses_exactly_once_per_key(policy):
    trace = _trace(alpha=1.2, k=5, requests=1500, docs=300, replace=False, doc_tokens="uniform:8:64")
    r = simulate(trace, SimConfig(policy, math.inf, SHAPE))
    first_seen: dict = {}
    for req in trace:
        path: tuple = ()
        for c, off in zip(req.chunks, req.chunk_offsets()):
            path += (c.doc,)
            key = {"tessera": c.doc, "position_aware": (c.doc, off), "prefix": path}[policy]
            first_seen.setdefault(key, c.tokens)
    assert r.evictions == 0
    assert r.insertions == len(first_seen)
    assert r.hit_tokens == r.chunk_tokens - sum(first_seen.values())


@pytest.mark.parametrize("eviction", sorted(EVICTIONS))
def test_policies_rank_as_expected(eviction):
    trace = _trace(alpha=1.1, k=4, requests=4000, docs=5000, replace=False, doc_tokens="const:512")
    for budget in ("1GB", "10GB"):
        hit = {p: simulate(trace, SimConfig(p, parse_bytes(budget), SHAPE, eviction)).hit_ratio
               for p in ("prefix", "position_aware", "tessera", "oracle_static_agnostic")}
        assert hit["tessera"] > 1.2 * hit["position_aware"] > 1.2 * hit["prefix"] > 0, hit
        assert hit["oracle_static_agnostic"] >= 0.9 * hit["tessera"], hit


@pytest.mark.slow
def test_more_budget_never_hurts_lru():
    trace = _trace(alpha=1.1, k=4, requests=2000, docs=2000, replace=False, doc_tokens="const:256")
    for policy in ("prefix", "position_aware", "tessera"):
        ratios = [simulate(trace, SimConfig(policy, parse_bytes(b), SHAPE)).hit_ratio
                  for b in ("0", "100MB", "1GB", "10GB", "unlimited")]
        assert ratios[0] == 0 and ratios == sorted(ratios), (policy, ratios)


@pytest.mark.parametrize("eviction", sorted(EVICTIONS))
def test_caches_stay_within_budget(eviction):
    rnd = random.Random(1)
    cache = make_cache(eviction, 1000)
    for _ in range(5000):
        key = int(rnd.paretovariate(1.0)) % 300
        if not cache.lookup(key):
            cache.insert(key, rnd.randint(1, 200))
        assert 0 <= cache.used <= 1000
    assert not cache.insert("huge", 1001) and cache.rejected == 1
    assert cache.evictions > 0 and cache.peak <= 1000


def test_lru_and_lfu_evict_the_right_entry():
    lru = make_cache("lru", 3)
    for k in "abc":
        lru.insert(k, 1)
    lru.lookup("a")
    lru.insert("d", 1)
    assert "b" not in lru and "a" in lru
    lfu = make_cache("lfu", 3)
    for k in "abc":
        lfu.insert(k, 1)
    for _ in range(3):
        lfu.lookup("a")
    lfu.lookup("b")
    lfu.insert("d", 1)
    assert "c" not in lfu and {"a", "b", "d"} <= {k for k in "abcd" if k in lfu}


@pytest.mark.parametrize("eviction,survives", [("s3fifo", True), ("lfu", True), ("lru", False)])
def test_a_scan_of_one_hit_wonders(eviction, survives):
    cache = make_cache(eviction, 20)
    cache.insert("hot", 1)
    for _ in range(3):
        assert cache.lookup("hot")
    for i in range(100):
        cache.insert(i, 1)
    assert ("hot" in cache) is survives


def test_bytes_and_shapes():
    assert SHAPE.kv_bytes_per_token == 32 * 8 * 128 * 2 * 2 == 131072
    assert ModelShape.from_name("80:8:128").kv_bytes_per_token == 327680
    assert parse_bytes("1GB") == 1e9 and parse_bytes("10GiB") == 10 * 2**30
    assert parse_bytes("unlimited") == math.inf and parse_bytes("512") == 512
    for bad in ("1XB", "-1GB", "lots"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    with pytest.raises(ValueError):
        ModelShape.from_name("gpt-9")
    with pytest.raises(ValueError):
        SimConfig("lifo", 1, SHAPE)


def test_cli_simulate_json(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    write_trace(path, _trace(alpha=1.1, k=4, requests=300, docs=200, replace=False, doc_tokens="const:64"))
    assert main(["simulate", str(path), "--policy", "tessera", "--budget-bytes", "1GB",
                 "--model-shape", "llama3-8b", "--eviction", "s3fifo", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "tessera" and out["eviction"] == "s3fifo" and out["budget_bytes"] == 10**9
    assert 0 < out["hit_ratio"] == out["hit_tokens"] / out["chunk_tokens"]
    assert main(["simulate", str(path), "--policy", ",".join(POLICIES), "--json"]) == 0
    assert [r["policy"] for r in json.loads(capsys.readouterr().out)["results"]] == list(POLICIES)


def test_small_sweep_table_shape(tmp_path, capsys):
    cfg = SweepConfig(trace=SynthConfig(docs=2000, chunks_per_request=4, requests=800,
                                        doc_tokens=LengthDist.parse("const:512")),
                      budgets=("1GB", "unlimited"), alphas=(1.1, 2.1))
    results = run_sweep(cfg)
    assert len(results) == 2 * 2 * 3
    table = sweep_table(cfg, results)
    rows = table.splitlines()
    assert rows[0].startswith("| policy | 1GB α=1.1 | 1GB α=2.1 | unlimited α=1.1")
    assert [r.split(" |")[0] for r in rows[2:]] == ["| prefix", "| position_aware", "| tessera",
                                                     "| tessera / position_aware"]
    assert Counter(r.policy for r in results) == {"prefix": 4, "position_aware": 4, "tessera": 4}
    out = tmp_path / "sweep"
    assert main(["simulate", "--sweep", "--budgets", "1GB", "--alphas", "1.5", "--docs", "500",
                 "--requests", "200", "-o", str(out)]) == 0
    assert "tessera simulate --sweep --budgets 1GB --alphas 1.5 --docs 500" in out.with_suffix(".md").read_text()
    assert len(json.loads(out.with_suffix(".json").read_text())["results"]) == 3


def _small_trace_file(tmp_path):
    path = tmp_path / "t.jsonl"
    trace = _trace(alpha=1.1, k=4, requests=300, docs=200, replace=False, doc_tokens="const:64")
    write_trace(path, trace)
    return path, trace


def test_budget_bytes_takes_a_list_one_result_each(tmp_path, capsys):
    path, _ = _small_trace_file(tmp_path)
    assert main(["simulate", str(path), "--policy", "tessera,prefix", "--budget-bytes", "1e8,4e8,16e8",
                 "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert [(r["policy"], r["budget_bytes"]) for r in results] == [
        (p, b) for p in ("tessera", "prefix") for b in (10**8, 4 * 10**8, 16 * 10**8)]
    for policy in ("tessera", "prefix"):
        ratios = [r["hit_ratio"] for r in results if r["policy"] == policy]
        assert 0 < ratios[0] < ratios[-1], ratios
    assert main(["simulate", str(path), "--budget-bytes", "1GB,2GB"]) == 0
    assert len([line for line in capsys.readouterr().out.splitlines() if "hit ratio" in line]) == 2
    assert parse_bytes("4e9") == 4e9 and parse_bytes("1.5e3kB") == 1.5e6


def test_sweep_applies_to_the_given_trace(tmp_path, capsys):
    path, trace = _small_trace_file(tmp_path)
    out = tmp_path / "sweep"
    assert main(["simulate", str(path), "--sweep", "--budgets", "10MB,unlimited", "--json",
                 "-o", str(out)]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["trace"] == str(path) and "alphas" not in payload
    assert payload["command"] == (f"tessera simulate {path} --sweep --budgets 10MB,unlimited "
                                  "--policy prefix,position_aware,tessera --model-shape llama3-8b --eviction lru")
    got = {(r["policy"], r["budget_bytes"]): r["hit_tokens"] for r in payload["results"]}
    assert got == {(p, b): simulate(trace, SimConfig(p, parse_bytes(b or "unlimited"), SHAPE)).hit_tokens
                   for p in ("prefix", "position_aware", "tessera") for b in (10**7, None)}
    md = out.with_suffix(".md").read_text()
    assert f"- Trace: {path}, 300 requests" in md and "| policy | 10MB | unlimited |" in md
    assert main(["simulate", str(path), "--sweep", "--budgets", "1GB", "--policy", "tessera,oracle_static_agnostic"]) == 0
    table = capsys.readouterr().out
    assert "| tessera |" in table and "| oracle_static_agnostic |" in table and "| prefix |" not in table


@pytest.mark.parametrize("argv,message", [
    (["--sweep", "--alphas", "1.1"], "--alphas describe synthetic traces: drop them, or drop TRACE"),
    (["--sweep", "--docs", "5", "--with-replacement"], "--docs, --with-replacement describe synthetic"),
    (["--sweep", "--budget-bytes", "1GB"], "--sweep takes its budgets from --budgets, not --budget-bytes"),
    (["--budgets", "1GB"], "--budgets only apply to --sweep"),
    (["--requests", "5", "-o", "x"], "--requests, --output only apply to --sweep"),
    (["--budget-bytes", ","], "--budget-bytes names no budget"),
])
def test_simulate_refuses_options_it_would_not_use(tmp_path, capsys, argv, message):
    path, _ = _small_trace_file(tmp_path)
    assert main(["simulate", str(path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tessera simulate: error: ") and message in err and len(err.splitlines()) == 1


def test_the_simulator_runs_the_stores_eviction_without_grpc_or_torch():
    """LRU and S3-FIFO are the store's own (services/kvstore/policy.py), reached without the store's heavy imports."""
    code = ("import sys; from loadgen.sim.caches import make_cache; make_cache('s3fifo', 10).insert('a', 1); "
            "print(sorted({'grpc', 'torch', 'services.rpc'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
