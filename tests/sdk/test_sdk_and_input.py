"""The gateway's refusals and the SDK's error paths, against services run in this process."""

from __future__ import annotations

import asyncio

import pytest

from services.sdk import (AsyncClient, ChunkId, Client, DeadlineExceeded, DecodeStats, InvalidArgument,
                          Unauthenticated, Unavailable)

from tests.helpers import MAX_POSITIONS, docs


@pytest.fixture(scope="module")
def client(inproc):
    with Client(inproc.address, token=inproc.token, timeout=60) as c:
        yield c


def test_generate_matches_the_engine(client, reference):
    chunks, suffix = docs(2, 48, seed=1), [7, 8, 9]
    got = client.complete(chunks, suffix, max_new_tokens=12, stop_token_ids=[])
    assert list(got.token_ids) == reference.generate(chunks, suffix, max_new_tokens=12, stop_token_ids=[])
    assert got.finish_reason == "length"
    assert sum(got.stats.chunk_tokens_by_tier.values()) == 96
    assert got.stats.prompt_tokens == 99 and got.stats.output_tokens == 12
    d = got.stats.decode        # the first token is the prefill worker's: 11 decode steps, each reading every page
    assert d.policy == "dense" and d.steps == 11 and d.pages_read == d.pages_visible > 0 and d.pages_corrected == 0


def test_text_chunks_are_tokenized_by_the_gateway(client, reference):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{reference.model_dir}/tokenizer.json")
    texts = ["Tessera computes each document once. ", "Then reuses it anywhere. "]
    got = client.complete(texts, "Why?", max_new_tokens=6, stop_token_ids=[])
    ids = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    want = reference.generate(ids, tok.encode("Why?", add_special_tokens=False).ids, max_new_tokens=6,
                              stop_token_ids=[])
    assert list(got.token_ids) == want
    assert got.text == tok.decode(want)


def test_registered_chunks_are_named_by_id(client, reference):
    chunks = docs(2, 40, seed=2)
    reg = client.register_chunks(chunks)
    assert [r.num_tokens for r in reg] == [40, 40] and all(r.stored for r in reg)
    assert reg[0].chunk_id == reference.chunk_id(chunks[0])
    got = client.complete([ChunkId(reg[1].chunk_id), ChunkId(reg[0].chunk_id)], [1, 2], max_new_tokens=5,
                          stop_token_ids=[])
    assert list(got.token_ids) == reference.generate([chunks[1], chunks[0]], [1, 2], max_new_tokens=5,
                                                     stop_token_ids=[])
    assert got.stats.chunk_tokens_by_tier == {"gpu": 80}


def test_store_hit_after_device_caches_are_dropped(client, reference):
    chunks = docs(2, 64, seed=3)
    assert all(r.stored for r in client.register_chunks(chunks))
    client.reset_caches(device_only=True)
    # a fixed ratio: left to the loading controller, it would follow the measured load time
    got = client.complete(chunks, [5], max_new_tokens=6, recompute_ratio=0.15, stop_token_ids=[])
    assert got.stats.chunk_tokens_by_tier == {"dram": 128}
    # every layer of both chunks was streamed in; the part of the stream the pass did not wait for overlapped
    assert got.stats.loaded_bytes == 128 * reference.describe_memory()["kv_bytes_per_token"]
    assert 0 <= got.stats.load_wait_seconds <= got.stats.load_seconds
    assert list(got.token_ids) == reference.generate(chunks, [5], max_new_tokens=6, stop_token_ids=[])


def test_stop_token_ends_like_the_engine(client, reference):
    chunks, suffix = docs(1, 32, seed=4), [3]
    want = reference.generate(chunks, suffix, max_new_tokens=8, stop_token_ids=[])
    stop = want[2]
    got = client.complete(chunks, suffix, max_new_tokens=8, stop_token_ids=[stop])
    assert list(got.token_ids) == reference.generate(chunks, suffix, max_new_tokens=8, stop_token_ids=[stop])
    assert got.finish_reason == "stop"


def test_seeded_sampling_equals_the_engine_across_the_handoff(client, reference):
    # the prefill worker samples the first token, the decode worker the rest: one seeded stream all the same
    chunks, suffix = docs(2, 40, seed=6), [4, 5]
    kw = dict(max_new_tokens=10, temperature=0.9, top_k=20, seed=1234, stop_token_ids=[])
    got = client.complete(chunks, suffix, **kw)
    assert list(got.token_ids) == reference.generate(chunks, suffix, **kw)


def test_first_token_comes_from_the_prefill_worker(client, reference):
    chunks, suffix = docs(2, 40, seed=7), [6]
    got = client.complete(chunks, suffix, max_new_tokens=5, stop_token_ids=[])
    st = got.stats
    assert 0 < st.first_token_seconds <= st.prefill_seconds
    assert st.handoff_bytes > 0 and st.handoff_seconds > 0
    # a request the first token completes is never handed off
    one = client.complete(chunks, suffix, max_new_tokens=1, stop_token_ids=[])
    assert list(one.token_ids) == list(got.token_ids[:1]) and one.finish_reason == "length"
    assert one.stats.handoff_bytes == 0 and one.stats.handoff_seconds == 0
    assert one.stats.decode == DecodeStats("dense")     # no decode step
    stop = got.token_ids[0]
    ends = client.complete(chunks, suffix, max_new_tokens=5, stop_token_ids=[stop])
    assert list(ends.token_ids) == [stop] and ends.finish_reason == "stop" and ends.stats.handoff_bytes == 0


@pytest.mark.parametrize("kwargs, reason", [
    (dict(chunks=[ChunkId("not-registered")], suffix=[1]), "unknown chunk id 'not-registered'"),
    (dict(chunks=[], suffix=[]), "empty request"),
    (dict(chunks=[[]], suffix=[1]), "chunk 0 holds no token"),
    (dict(chunks=[[1] * (MAX_POSITIONS - 8)], suffix=[1, 2], max_new_tokens=16), "past the model's limit"),
    (dict(chunks=[[1, 2]], suffix=[1], temperature=-0.5), "temperature must be"),
    (dict(chunks=[[1, 2]], suffix=[1], top_p=1.5), "top_p must be in (0, 1]"),
    (dict(chunks=[[1, 2]], suffix=[1], top_k=-3), "top_k must be >= 0"),
    (dict(chunks=[[1, 2]], suffix=[1], max_new_tokens=0), "max_new_tokens must be"),
    (dict(chunks=[[1, 100000]], suffix=[1]), "token id 100000 in chunk 0 is outside the vocabulary"),
    (dict(chunks=[[1, 2]], suffix=[1], mode="sideways"), "unknown mode 'sideways'"),
    (dict(chunks=[[1, 2]], suffix=[1], recompute_ratio=1.5), "recompute_ratio must be in [0, 1]"),
    (dict(chunks=[[1, 2]], suffix=[1], decode="sparse"),
     "decode must be one of dense, quest, retro, retrieval, got 'sparse'"),
    (dict(chunks=[[1, 2]], suffix=[1], budget_tokens=64), "decode 'dense' takes no budget_tokens"),
    (dict(chunks=[[1, 2]], suffix=[1], decode="quest", budget_tokens=0), "budget_tokens must be at least 1"),
    (dict(chunks=[[1, 2]], suffix=[1], decode="quest", dense_layers=99), "dense_layers must be at most"),
    # a budget under one page passes the gateway, which does not know the workers' block size: the prefill worker's
    # engine refuses it before any pass, naming the field
    (dict(chunks=[[1, 2]], suffix=[1], decode="quest", budget_tokens=8), "budget_tokens must be at least one page"),
    (dict(chunks=[[1, 2]], suffix=[1], decode="retro", retro_window=0), "retro_window must be in 1..16, got 0"),
    (dict(chunks=[[1, 2]], suffix=[1], decode="retro", retro_window=17), "retro_window must be in 1..16, got 17"),
    (dict(chunks=[[1, 2]], suffix=[1], decode="retro", retro_window=2.5), "retro_window must be an integer, got 2.5"),
    (dict(chunks=[[1, 2]], suffix=[1], decode="retro", retro_window=True), "retro_window must be an integer, got True"),
    (dict(chunks=[[1, 2]], suffix=[1], decode="quest", retro_window=2), "decode 'quest' takes no retro_window"),
    (dict(chunks=[[1, 2]], suffix=[1], decode="retro", dense_layers=4), "dense_layers must leave a sparse layer"),
    (dict(chunks=[[1, 2]], suffix=[1], decode="retro", budget_tokens=8), "budget_tokens must be at least one page"),
    (dict(chunks=[[1, 2]], suffix=[1], decode="retrieval", retrieval_k=65537),
     "retrieval_k must be in 0..65536, got 65537"),
    (dict(chunks=[[1, 2]], suffix=[1], decode="retrieval", sink_tokens=-1), "sink_tokens must be"),
    (dict(chunks=[[1, 2]], suffix=[1], decode="retrieval", retro_window=2), "decode 'retrieval' takes no retro_window"),
], ids=["unknown-chunk", "empty", "empty-chunk", "too-long", "temperature", "top_p", "top_k",
        "max_new_tokens", "vocab", "mode", "ratio", "decode", "dense-budget", "zero-budget", "dense-layers",
        "sub-page-budget", "retro-window-0", "retro-window-17", "retro-window-float", "retro-window-bool",
        "quest-window", "retro-dense-layers", "retro-sub-page-budget", "retrieval-k-big", "retrieval-sink-negative",
        "retrieval-window"])
def test_bad_input_is_invalid_argument_with_the_reason(client, kwargs, reason):
    with pytest.raises(InvalidArgument) as info:
        client.complete(**kwargs)
    assert info.value.code == "INVALID_ARGUMENT"
    assert reason in str(info.value)


def test_quest_decode_through_the_cluster(client, reference):
    """decode="quest" reaches the decode worker: with a budget covering every page it generates the engine's dense
    tokens; with a one-page budget it still generates (what it attends is the policy's, tested in the engine)."""
    chunks, suffix = docs(2, 48, seed=3), [4, 5, 6]
    want = reference.generate(chunks, suffix, max_new_tokens=10, stop_token_ids=[])
    wide = client.complete(chunks, suffix, max_new_tokens=10, stop_token_ids=[], decode="quest", budget_tokens=4096,
                           dense_layers=0)
    assert list(wide.token_ids) == want
    assert wide.stats.decode.policy == "quest" and wide.stats.decode.pages_read == wide.stats.decode.pages_visible
    narrow = client.complete(chunks, suffix, max_new_tokens=10, stop_token_ids=[], decode="quest", budget_tokens=16)
    assert len(narrow.token_ids) == 10 and narrow.finish_reason == "length"
    d = narrow.stats.decode
    assert d.policy == "quest" and d.steps == 9 and 0 < d.pages_read < d.pages_visible and d.pages_corrected == 0


def test_retro_decode_through_the_cluster(client, inproc, reference):
    """decode="retro" reaches the decode worker: with a budget covering every page it generates the engine's dense
    tokens; with a tight one it reads fewer pages than dense and corrects past tokens with some of them. The request's
    stats carry those figures, and the decode worker's counters move by them under the policy's name."""
    chunks, suffix = docs(2, 48, seed=8), [4, 5, 6]
    want = reference.generate(chunks, suffix, max_new_tokens=8, stop_token_ids=[])
    wide = client.complete(chunks, suffix, max_new_tokens=8, stop_token_ids=[], decode="retro", budget_tokens=4096,
                           dense_layers=0, retro_window=3)
    assert list(wide.token_ids) == want
    assert wide.stats.decode.policy == "retro" and wide.stats.decode.pages_read == wide.stats.decode.pages_visible
    value = inproc.decode.servicer.metrics.registry.get_sample_value
    names = ("sequence_steps", "pages_visible", "pages_read", "pages_corrected")

    def counters():
        return [value(f"tessera_decode_{n}_total", {"policy": "retro"}) for n in names]

    before = counters()
    tight = client.complete(chunks, suffix, max_new_tokens=20, stop_token_ids=[], decode="retro", budget_tokens=32,
                            dense_layers=1, retro_window=4)
    assert len(tight.token_ids) == 20 and tight.finish_reason == "length"
    d = tight.stats.decode
    assert d.policy == "retro" and d.steps == 19 and 0 < d.pages_read < d.pages_visible and d.pages_corrected > 0
    assert [a - b for a, b in zip(counters(), before)] == [d.steps, d.pages_visible, d.pages_read, d.pages_corrected]


def test_retrieval_decode_through_the_cluster(client, inproc, reference):
    """decode="retrieval" reaches the decode worker with the prefill pass's queries in the hand-off: retrieving every
    offloaded key it generates the engine's dense tokens; with a small k it scans keys on the decode worker's index
    set, and the request's stats and the worker's counters say how many."""
    chunks, suffix = docs(3, 48, seed=9), [4, 5, 6]
    want = reference.generate(chunks, suffix, max_new_tokens=8, stop_token_ids=[])
    small = dict(sink_tokens=4, window_tokens=8)
    wide = client.complete(chunks, suffix, max_new_tokens=8, stop_token_ids=[], decode="retrieval",
                           retrieval_k=4096, **small)
    assert list(wide.token_ids) == want
    value = inproc.decode.servicer.metrics.registry.get_sample_value
    before = value("tessera_decode_keys_scanned_total", {"policy": "retrieval"}) or 0.0
    tight = client.complete(chunks, suffix, max_new_tokens=8, stop_token_ids=[], decode="retrieval", retrieval_k=3,
                            **small)
    d = tight.stats.decode
    assert len(tight.token_ids) == 8 and d.policy == "retrieval" and d.steps == 7
    assert 0 < d.pages_read < d.pages_visible and d.keys_scanned > 0 and d.retrieval_seconds > 0
    assert value("tessera_decode_keys_scanned_total", {"policy": "retrieval"}) - before == d.keys_scanned


def test_a_refused_decode_policy_changes_nothing(client, inproc, reference):
    """A bad decode policy is refused before anything is tokenized, prefilled or stored (the SDK refuses what the
    message cannot carry, the gateway the rest), and the workers go on serving."""
    chunks, suffix, text = docs(2, 40, seed=12), [3, 4], "A document only refused requests carried. "
    resolver = inproc.gateway.servicer.resolver
    invalid = inproc.gateway.servicer.metrics.registry.get_sample_value
    admitted = inproc.decode.servicer.metrics.registry.get_sample_value
    before = (resolver.text_cache.misses, invalid("tessera_gateway_requests_total", {"outcome": "invalid"}),
              admitted("tessera_decode_admitted_total"))
    for bad in (dict(decode="retro", retro_window=0), dict(decode="retro", retro_window=17),
                dict(decode="retro", retro_window=2.5), dict(decode="retro", retro_window=True),
                dict(decode="quest", retro_window=2), dict(decode="sparse"), dict(decode="retrieval", retrieval_k=65537)):
        with pytest.raises(InvalidArgument, match="retro_window|retrieval_k|decode must be one of") as info:
            client.complete([*chunks, text], suffix, max_new_tokens=4, **bad)
        assert info.value.code == "INVALID_ARGUMENT"
    # five reached the gateway (a float and a bool never leave the SDK); none was tokenized or reached a worker
    assert (resolver.text_cache.misses, invalid("tessera_gateway_requests_total", {"outcome": "invalid"}),
            admitted("tessera_decode_admitted_total")) == (before[0], before[1] + 5, before[2])
    # a budget under one page reaches the prefill worker (the gateway does not know the block size), which refuses
    # it before any pass
    for policy in ("quest", "retro"):
        with pytest.raises(InvalidArgument, match="budget_tokens must be at least one page"):
            client.complete(chunks, suffix, max_new_tokens=4, decode=policy, budget_tokens=8)
    got = client.complete(chunks, suffix, max_new_tokens=4, stop_token_ids=[], decode="retro", retro_window=16)
    assert got.stats.chunk_tokens_by_tier == {"computed": 80}       # no refused call computed or stored them
    assert len(got.token_ids) == 4 and got.stats.decode.policy == "retro"


def test_register_refuses_ids_and_nothing(client):
    with pytest.raises(InvalidArgument, match="empty request"):
        client.register_chunks([])
    with pytest.raises(InvalidArgument, match="holds no token"):
        client.register_chunks([""])


def test_missing_or_wrong_token_is_unauthenticated(inproc):
    for token in (None, "wrong"):
        with Client(inproc.address, token=token, timeout=10) as c:
            with pytest.raises(Unauthenticated, match="bearer token"):
                c.stats()
            with pytest.raises(Unauthenticated):
                c.complete([[1]], [2], max_new_tokens=1)


def test_stats_describe_the_cluster(client):
    st = client.stats()
    assert st.vocab_size == 320 and st.max_position_embeddings == MAX_POSITIONS
    assert {w.role for w in st.workers} == {"prefill", "decode"} and all(w.healthy for w in st.workers)
    assert "grpc" in st.transport and "nixl" in st.transport


def test_metrics_endpoints_use_base_units(client):
    import urllib.request

    client.complete(docs(1, 16, seed=5), [1], max_new_tokens=3, stop_token_ids=[])
    st = client.stats()
    text = urllib.request.urlopen(st.metrics_url, timeout=10).read().decode()
    for name in ("tessera_gateway_ttft_seconds_bucket", "tessera_gateway_tpot_seconds_bucket",
                 "tessera_gateway_e2e_seconds_bucket", "tessera_gateway_queue_seconds_bucket",
                 'tessera_gateway_requests_total{outcome="ok"}', 'tessera_gateway_requests_total{outcome="invalid"}'):
        assert name in text
    prefill = next(w for w in st.workers if w.role == "prefill")
    text = urllib.request.urlopen(prefill.metrics_url, timeout=10).read().decode()
    for name in ('tessera_prefill_chunk_hits_total{tier="computed"}', "tessera_prefill_recomputed_tokens_total",
                 "tessera_prefill_loaded_bytes_total", "tessera_prefill_handoff_bytes_total",
                 'tessera_prefill_handoffs_total{transport="grpc"}'):   # a CPU cluster's hand-offs: the stream
        assert name in text
    decode = next(w for w in st.workers if w.role == "decode")
    text = urllib.request.urlopen(decode.metrics_url, timeout=10).read().decode()
    assert "tessera_decode_handoff_bytes_total" in text and "tessera_decode_batch_size_bucket" in text
    for name in ("sequence_steps", "pages_visible", "pages_read", "pages_corrected"):
        assert f'tessera_decode_{name}_total{{policy="dense"}}' in text


def test_async_client_streams_the_same_tokens(inproc, reference):
    chunks, suffix = docs(2, 24, seed=6), [4, 4]

    async def run():
        async with AsyncClient(inproc.address, token=inproc.token) as c:
            out = []
            async for ev in c.generate(chunks, suffix, max_new_tokens=7, stop_token_ids=[]):
                out += ev.token_ids
            with pytest.raises(InvalidArgument, match="unknown chunk id"):
                async for _ in c.generate([ChunkId("nope")], [1]):
                    pass
            return out, (await c.stats()).vocab_size

    out, vocab = asyncio.run(run())
    assert out == reference.generate(chunks, suffix, max_new_tokens=7, stop_token_ids=[])
    assert vocab == 320


def test_unreachable_gateway_is_unavailable_after_retries():
    from services.cluster.serving import free_port

    with Client(f"127.0.0.1:{free_port()}", timeout=10, retries=2, backoff_s=0.05) as c:
        with pytest.raises(Unavailable, match="UNAVAILABLE"):
            c.stats()
        with pytest.raises(Unavailable):
            c.complete([[1]], [2])


def test_deadline_is_carried_and_reported(client):
    with pytest.raises(DeadlineExceeded, match="DEADLINE_EXCEEDED"):
        client.complete(docs(4, 200, seed=7), [1], max_new_tokens=200, stop_token_ids=[], timeout=0.001)


@pytest.mark.slow
def test_unavailable_is_retried_until_the_gateway_comes_up(tiny_model, inproc):
    """A gateway that starts while the client is retrying is reached (UNAVAILABLE is retried)."""
    import threading

    from services.cluster.serving import free_port
    from services.gateway.server import create_server

    port = free_port()
    workers = [(w.name, w.role, w.address) for w in inproc.gateway.servicer.router.workers.values()]
    started = []

    def start_late():
        import time

        time.sleep(0.5)
        started.append(inproc.loop.run(create_server(tiny_model, workers, port=port, cluster_tls=inproc.cluster_tls))[0])

    t = threading.Thread(target=start_late)
    t.start()
    try:
        with Client(f"127.0.0.1:{port}", timeout=60, retries=8, backoff_s=0.2) as c:
            assert c.stats().vocab_size == 320
    finally:
        t.join()
        for server in started:
            inproc.loop.run(server.stop(0.1))


@pytest.mark.slow
def test_tls_gateway_needs_a_tls_client(tiny_model, inproc, reference, tmp_path):
    from services.gateway.server import create_server

    from tests.helpers import self_signed

    cert, key, cert_path = self_signed(tmp_path)
    workers = [(w.name, w.role, w.address) for w in inproc.gateway.servicer.router.workers.values()]
    server, port = inproc.loop.run(create_server(tiny_model, workers, tls=(cert, key), cluster_tls=inproc.cluster_tls))
    try:
        with Client(f"127.0.0.1:{port}", tls=cert_path, timeout=30) as c:
            chunks = docs(1, 20, seed=8)
            got = c.complete(chunks, [1], max_new_tokens=4, stop_token_ids=[])
            assert list(got.token_ids) == reference.generate(chunks, [1], max_new_tokens=4, stop_token_ids=[])
        with Client(f"127.0.0.1:{port}", timeout=5, retries=0) as plain:
            with pytest.raises(Unavailable):
                plain.stats()
    finally:
        inproc.loop.run(server.stop(0.1))


def test_a_stream_left_early_frees_its_decode_slot(client):
    import urllib.request

    from tests.helpers import wait_until

    decode = next(w for w in client.stats().workers if w.role == "decode")

    def metric(prefix: str) -> float:
        text = urllib.request.urlopen(decode.metrics_url, timeout=10).read().decode()
        line = next((ln for ln in text.splitlines() if ln.startswith(prefix)), None)
        return float(line.split()[-1]) if line else 0.0

    def cancelled() -> float:
        return metric('tessera_decode_finished_total{reason="cancelled"}')

    # earlier tests' abandoned calls may still be winding down: count from an idle cluster, no sequence in the batch
    def idle() -> bool:
        return (all(w.in_flight == 0 for w in client.stats().workers)
                and metric("tessera_decode_active_sequences ") == 0)

    wait_until(idle, 30, 0.1, "an idle cluster")
    before = cancelled()
    stream = client.generate(docs(1, 16, seed=9), [1], max_new_tokens=500, stop_token_ids=[])
    assert next(stream).token_ids                    # the first token, sampled by the prefill worker
    assert next(stream).token_ids                    # the second, from the decode worker
    stream.close()                                   # the caller stops reading after two tokens
    # the sequence ends as cancelled (not after its 500 tokens) and leaves the batch
    wait_until(lambda: cancelled() == before + 1, 30, 0.1, "the decode worker to cancel the abandoned sequence")
    wait_until(lambda: all(w.in_flight == 0 for w in client.stats().workers), 30, 0.1, "no request in flight")


@pytest.mark.slow
def test_gateway_health_follows_its_workers(tiny_model, inproc):
    """A gateway whose only decode worker does not answer reports NOT_SERVING (health checks see it)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.cluster.serving import free_port
    from services.gateway.server import SERVICE_NAME, create_server

    from tests.helpers import wait_until

    prefill = next(w for w in inproc.gateway.servicer.router.workers.values() if w.role == "prefill")
    workers = [(prefill.name, "prefill", prefill.address), ("ghost", "decode", f"127.0.0.1:{free_port()}")]
    server, port = inproc.loop.run(create_server(tiny_model, workers, cluster_tls=inproc.cluster_tls))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)

            def status():
                return stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5).status

            wait_until(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING, 30, 0.1, "NOT_SERVING")
    finally:
        inproc.loop.run(server.stop(0.1))
    # the module's own gateway has both workers: it serves
    with grpc.insecure_channel(inproc.address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
