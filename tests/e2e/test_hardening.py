"""Adversarial requests against services run in this process: none stops a worker, none reads or
changes what it should not."""

from __future__ import annotations

import os

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.sdk import Client

from tests.helpers import docs


@pytest.fixture(scope="module")
def client(inproc):
    with Client(inproc.address, token=inproc.token, timeout=60) as c:
        yield c


def _health(address: str, creds=None) -> int:
    with (grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-9])
def test_a_degenerate_temperature_is_served_and_decoding_goes_on(client, reference, temperature):
    """A temperature that overflows the scaled logits killed the decode worker's engine thread (every later
    request hung while health said SERVING), or failed with a Python exception's text."""
    chunks, suffix = docs(2, 32, seed=11), [5, 6, 7]
    greedy = reference.generate(chunks, suffix, max_new_tokens=8, stop_token_ids=[])
    got = client.complete(chunks, suffix, max_new_tokens=8, stop_token_ids=[], temperature=temperature, seed=3)
    assert list(got.token_ids) == greedy           # that small a temperature is greedy
    after = client.complete(chunks, [9], max_new_tokens=4, stop_token_ids=[])
    assert list(after.token_ids) == reference.generate(chunks, [9], max_new_tokens=4, stop_token_ids=[])


@pytest.mark.parametrize("last", [40, 1], ids=["last-chunk-40", "last-chunk-1-token"])
def test_a_request_of_chunks_only_is_served(client, reference, last):
    """Every public Mooncake trace line is chunks only; the cluster refused them all ("the suffix must hold
    at least one token"). The last chunk's last token is computed privately: the output is the engine's over
    the same prompt, the rest of that chunk is cached as a chunk of its own."""
    chunks = docs(2, 48, seed=31)[:1] + docs(1, last, seed=32)
    prompt = [t for c in chunks for t in c]
    served = chunks[:-1] + ([chunks[-1][:-1]] if last > 1 else [])
    want = reference.generate(served, chunks[-1][-1:], max_new_tokens=6, stop_token_ids=[])
    got = client.complete(chunks, [], max_new_tokens=6, stop_token_ids=[])
    assert list(got.token_ids) == want
    assert got.stats.prompt_tokens == len(prompt)
    assert sum(got.stats.chunk_tokens_by_tier.values()) == len(prompt) - 1      # the last token: the suffix


@pytest.mark.slow
def test_a_worker_gone_for_good_fails_requests_fast(tiny_model, inproc):
    """A worker whose restarts ran out stayed dead and each request failed UNAVAILABLE only after ~76 s (past
    the SDK's 60 s default). With Ray saying it is gone, the gateway fails requests at once, naming why."""
    import time

    from services.cluster.serving import free_port
    from services.gateway.peers import WorkerGone
    from services.gateway.server import create_server
    from services.sdk import Unavailable

    def resolve(name: str):
        if name == "prefill-0":
            raise WorkerGone("prefill-0 is not alive in Ray (its restarts ran out, or it was stopped)")
        return None

    workers = [(w.name, w.role, w.address) for w in inproc.gateway.servicer.router.workers.values()]
    server, port = inproc.loop.run(create_server(tiny_model, workers, token=inproc.token, resolve=resolve,
                                                 cluster_tls=inproc.cluster_tls))
    try:
        view = server.servicer.router.workers["prefill-0"]
        view.address = f"127.0.0.1:{free_port()}"            # its process is gone: nothing answers there
        with Client(f"127.0.0.1:{port}", token=inproc.token, timeout=60) as c:
            deadline = time.monotonic() + 20
            while not view.gone and time.monotonic() < deadline:
                time.sleep(0.1)
            assert view.gone
            t0 = time.perf_counter()
            with pytest.raises(Unavailable, match="no prefill worker will serve: prefill-0 is not alive"):
                c.complete(docs(1, 8, seed=5), [1], max_new_tokens=2)
            assert time.perf_counter() - t0 < 2.0
    finally:
        inproc.loop.run(server.stop(0.1))


@pytest.mark.slow
def test_a_worker_whose_engine_loop_stopped_says_not_serving(tiny_model, inproc):
    """Health follows the engine thread, not the process: the loop's death (a broken device: see
    test_engine_faults) turns health NOT_SERVING, Status and Decode UNAVAILABLE at once, and on_fatal runs
    (a Ray actor exits there to be restarted)."""
    import threading

    from services.cluster.config import EngineSettings
    from services.decode.server import create_server
    from services.rpc import tessera_pb2 as pb
    from services.rpc import tessera_pb2_grpc as pb_grpc

    fatal = threading.Event()
    server, port = inproc.loop.run(create_server("decode-x", EngineSettings(tiny_model, kv_cache_bytes=16 << 20), [],
                                                 on_fatal=fatal.set))
    address = f"127.0.0.1:{port}"
    try:
        assert _health(address) == health_pb2.HealthCheckResponse.SERVING
        batcher = server.servicer.batcher
        batcher.failure = RuntimeError("CUDA error: unspecified launch failure")   # as _run records it
        batcher.on_fatal(batcher.failure)
        assert fatal.wait(10)
        assert _health(address) == health_pb2.HealthCheckResponse.NOT_SERVING
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.DecodeWorkerStub(ch)
            for call in (lambda: stub.Status(pb.WorkerStatusRequest(), timeout=5),
                         lambda: list(stub.Decode(pb.DecodeRequest(request_id="r"), timeout=5))):
                with pytest.raises(grpc.RpcError) as info:
                    call()
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "restarting" in info.value.details()
    finally:
        inproc.loop.run(server.stop(0.1))


def test_cheap_requests_with_expensive_effects_are_refused_first(client):
    """2,000 three-token chunks (14 s of prefill and 2,000 store writes) and a 6 MB text (seconds of tokenizing,
    its tokens then kept) were accepted; both are refused before any work, and the text leaves nothing cached."""
    import time

    from services.sdk import InvalidArgument, ResourceExhausted

    t0 = time.perf_counter()
    with pytest.raises(ResourceExhausted, match="max_chunks_per_request"):
        client.complete([[1, 2, 3]] * 2000, [1], max_new_tokens=1)
    big = "lorem ipsum " * 500_000
    with pytest.raises(InvalidArgument, match="cannot fit the model's limit"):
        client.complete([big], [1], max_new_tokens=1)
    assert time.perf_counter() - t0 < 5.0


def test_reset_caches_without_the_token_changes_nothing(inproc, client, reference):
    from services.sdk import Unauthenticated

    chunks, suffix = docs(2, 24, seed=71), [3]
    before = client.complete(chunks, suffix, max_new_tokens=4, stop_token_ids=[])
    for token in (None, "wrong-token"):
        with Client(inproc.address, token=token, timeout=10) as stranger:
            with pytest.raises(Unauthenticated):
                stranger.reset_caches()
    after = client.complete(chunks, suffix, max_new_tokens=4, stop_token_ids=[])
    assert list(after.token_ids) == list(before.token_ids)
    assert dict(after.stats.chunk_tokens_by_tier) == {"gpu": 48}          # nothing was dropped


@pytest.mark.slow
def test_the_in_process_local_ray_listens_on_loopback_with_a_private_token():
    """``tessera demo`` starts Ray in its own process (ensure_ray): it listened on every interface, and Ray's
    token file was written readable by every user."""
    import ast
    import subprocess
    import sys

    probe = (
        "import os, psutil\n"
        "from services.launch.on_ray import ensure_ray\n"
        "assert ensure_ray(num_cpus=1)\n"
        "import ray\n"
        "ray.get(ray.remote(lambda: 1).remote())\n"
        "me = psutil.Process(); pids = {me.pid} | {c.pid for c in me.children(recursive=True)}\n"
        "ips = {c.laddr.ip for c in psutil.net_connections('inet') if c.status == 'LISTEN' and c.pid in pids}\n"
        "print(sorted(ips), oct(os.stat(os.environ['RAY_AUTH_TOKEN_PATH']).st_mode & 0o777),"
        " oct(os.stat(os.path.dirname(os.environ['RAY_AUTH_TOKEN_PATH'])).st_mode & 0o777))\n"
        "ray.shutdown()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    ips, token_mode, dir_mode = out.stdout.strip().splitlines()[-1].rsplit(" ", 2)
    listening = ast.literal_eval(ips)
    assert listening and set(listening) <= {"127.0.0.1", "::ffff:127.0.0.1"}, listening
    assert (token_mode, dir_mode) == ("0o600", "0o700")


@pytest.mark.slow
def test_a_mooncake_trace_replays_through_the_cluster_with_no_failure(inproc, tmp_path, monkeypatch):
    """Plain Mooncake lines (chunks only, blocks of 512 tokens, the first block shared) were all refused by the
    cluster while the simulator and the fake accepted them; replay exited 0 regardless. Now every request is
    served and replay exits 0 because none failed."""
    import json

    from services.cli import main

    lines = [{"timestamp": 0, "input_length": 700, "output_length": 4, "hash_ids": [0, 1]},
             {"timestamp": 0, "input_length": 900, "output_length": 3, "hash_ids": [0, 2]},
             {"timestamp": 5, "input_length": 512, "output_length": 1, "hash_ids": [0]}]
    trace = tmp_path / "mooncake.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    monkeypatch.setenv("TESSERA_TOKEN", inproc.token)
    out = tmp_path / "out"
    assert main(["replay", str(trace), "--target", inproc.address, "--concurrency", "2", "-o", str(out)]) == 0
    summary = (out / "summary.md").read_text()
    assert "| Successful requests | 3 |" in summary and "| Failed requests | 0 |" in summary
