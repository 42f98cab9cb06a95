"""Faults: a worker or a store shard killed (SIGKILL) under load; Ray restarts it.

Requests in flight either complete with the right output (the gateway sent them again elsewhere)
or end with a clear UNAVAILABLE naming the worker; later requests succeed; a dead store only turns
hits into computed chunks, never into wrong output.
"""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.sdk import ChunkId, Client, Unavailable

from tests.helpers import docs, start_ray_cluster, wait_until

pytestmark = pytest.mark.slow

NAMESPACE = "tessera-test-faults"
# A fixed ratio: left to the loading controller, the ratio would follow measured load times.
RATIO = 0.15


@pytest.fixture(scope="module")
def cluster(local_ray, tiny_model, tmp_path_factory):
    c = start_ray_cluster(tiny_model, tmp_path_factory.mktemp("rocksdb"), NAMESPACE, prefill=2, decode=2, stores=1,
                          max_restarts=-1)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.gateway_address, timeout=180) as c:
        yield c


@pytest.fixture(autouse=True)
def settled(request):
    """Each fault test starts from a whole cluster: a restart left over from the test before (slow on a
    busy machine) must have finished, or this test would see its neighbour's fault instead of its own."""
    if "client" in request.fixturenames:
        client = request.getfixturevalue("client")
        wait_until(lambda: all(w.healthy for w in client.stats().workers), 180, 0.5, "every worker healthy")


def kill(cluster, local_ray, name: str) -> int:
    # the actor may still be coming back from an earlier kill: ask until it answers
    pid = wait_until(lambda: local_ray.get(cluster.actors[name].pid.remote(), timeout=10), 180, 0.5, f"{name} pid")
    os.kill(pid, signal.SIGKILL)
    return pid


def wait_restarted(cluster, local_ray, client, name: str, old_pid: int) -> None:
    handle = cluster.actors[name]
    wait_until(lambda: local_ray.get(handle.pid.remote(), timeout=10) != old_pid, 180, 0.5, f"{name} restarted")
    if "store" not in name:
        wait_until(lambda: all(w.healthy for w in client.stats().workers), 60, 0.25, "every worker healthy")


def expect(reference, chunks, suffix, n):
    return reference.generate(chunks, suffix, max_new_tokens=n, recompute_ratio=RATIO, stop_token_ids=[])


def test_killed_prefill_worker_is_retried_and_restarted(cluster, local_ray, client, reference):
    requests = [(docs(3, 96, seed=100 + i), [i + 1]) for i in range(16)]
    done = threading.Semaphore(0)

    def run(req):
        try:
            return client.complete(req[0], req[1], max_new_tokens=4, recompute_ratio=RATIO, stop_token_ids=[])
        finally:
            done.release()

    with ThreadPoolExecutor(4) as ex:
        futures = [ex.submit(run, r) for r in requests]
        assert done.acquire(timeout=120)
        old_pid = kill(cluster, local_ray, "tessera-prefill-0")
        outcomes = [f.exception(timeout=300) or f.result() for f in futures]
    for (chunks, suffix), out in zip(requests, outcomes):
        if isinstance(out, Exception):
            assert isinstance(out, Unavailable) and "worker" in str(out), repr(out)
        else:
            assert list(out.token_ids) == expect(reference, chunks, suffix, 4)
    assert sum(not isinstance(o, Exception) for o in outcomes) >= 12   # the other prefill worker took over
    wait_restarted(cluster, local_ray, client, "tessera-prefill-0", old_pid)
    for chunks, suffix in requests[:6]:
        out = client.complete(chunks, suffix, max_new_tokens=4, recompute_ratio=RATIO, stop_token_ids=[])
        assert list(out.token_ids) == expect(reference, chunks, suffix, 4)


def decode_retries(client) -> float:
    import urllib.request

    text = urllib.request.urlopen(client.stats().metrics_url, timeout=10).read().decode()
    line = next((ln for ln in text.splitlines() if ln.startswith('tessera_gateway_retries_total{role="decode"}')), None)
    return float(line.split()[-1]) if line else 0.0


def streams_through_a_fault(client, jobs, n_new, fault):
    """Run one generate stream per (chunks, suffix, temperature) job in its own thread; call ``fault()``
    once every stream has produced its first token; return (tokens per job, exception per job)."""
    got = [[] for _ in jobs]
    errors: list[Exception | None] = [None] * len(jobs)
    started = threading.Semaphore(0)

    def stream(i):
        chunks, suffix, temperature = jobs[i]
        first = True
        try:
            for ev in client.generate(chunks, suffix, max_new_tokens=n_new, temperature=temperature,
                                      recompute_ratio=RATIO, stop_token_ids=[]):
                got[i] += ev.token_ids
                if first and ev.token_ids:
                    first = False
                    started.release()
        except Exception as exc:  # noqa: BLE001 - examined by the caller
            errors[i] = exc
        finally:
            if first:
                started.release()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for _ in threads:
        assert started.acquire(timeout=120)
    result = fault()
    for t in threads:
        t.join(300)
    return got, errors, result


def test_killed_decode_worker_resumes_or_ends_streams_clearly(cluster, local_ray, client, reference):
    """Greedy streams resume on the other decode worker (same tokens, none repeated); unseeded
    sampled streams cannot be replayed and end UNAVAILABLE saying so, unless they were elsewhere."""
    n_new = 200
    prompts = [(docs(2, 32, seed=200 + i), [i + 1]) for i in range(4)]
    wanted = [expect(reference, chunks, suffix, n_new) for chunks, suffix in prompts]
    jobs = [(*p, 0.0) for p in prompts] + [(*p, 1.0) for p in prompts]   # (chunks, suffix, temperature)
    retries_before = decode_retries(client)
    got, errors, old_pid = streams_through_a_fault(
        client, jobs, n_new, lambda: kill(cluster, local_ray, "tessera-decode-0"))
    for i, want in enumerate(wanted):           # greedy: complete and right, resumed or not
        assert errors[i] is None, repr(errors[i])
        assert got[i] == want
    for tokens, err in zip(got[4:], errors[4:]):
        if err is None:
            assert len(tokens) == n_new
        else:
            assert isinstance(err, Unavailable), repr(err)
            assert "decode worker tessera-decode-0 failed after" in str(err) and "cannot be resumed" in str(err)
    assert decode_retries(client) > retries_before, "the killed decode worker was serving some of the streams"
    wait_restarted(cluster, local_ray, client, "tessera-decode-0", old_pid)
    for (chunks, suffix), want in zip(prompts, wanted):
        got_now = client.complete(chunks, suffix, max_new_tokens=5, recompute_ratio=RATIO, stop_token_ids=[])
        assert list(got_now.token_ids) == want[:5]


def test_greedy_streams_survive_every_decode_worker_dying(cluster, local_ray, client, reference):
    """No decode worker left: the gateway waits for Ray to restart one, then resumes the streams."""
    n_new = 200
    prompts = [(docs(2, 32, seed=250 + i), [i + 1]) for i in range(2)]
    wanted = [expect(reference, chunks, suffix, n_new) for chunks, suffix in prompts]
    got, errors, pids = streams_through_a_fault(
        client, [(*p, 0.0) for p in prompts], n_new,
        lambda: {name: kill(cluster, local_ray, name) for name in ("tessera-decode-0", "tessera-decode-1")})
    assert errors == [None, None], errors
    assert got == wanted
    for name, pid in pids.items():
        wait_restarted(cluster, local_ray, client, name, pid)


def test_killed_store_shard_falls_back_to_computing(cluster, local_ray, client, reference):
    chunks = docs(2, 64, seed=300)
    assert all(r.stored for r in client.register_chunks(chunks))
    old_pid = kill(cluster, local_ray, "tessera-store-0")
    client.reset_caches(device_only=True)       # now only the killed store held them
    got = client.complete(chunks, [9], max_new_tokens=6, recompute_ratio=RATIO, stop_token_ids=[])
    # computed while the shard is down; if Ray brought it back first, its RocksDB tier still has them
    assert got.stats.chunk_tokens_by_tier in ({"computed": 128}, {"rocksdb": 128}), got.stats
    assert list(got.token_ids) == expect(reference, chunks, [9], 6)
    wait_restarted(cluster, local_ray, client, "tessera-store-0", old_pid)
    fresh = docs(2, 48, seed=301)
    wait_until(lambda: all(r.stored for r in client.register_chunks(fresh)), 60, 0.5, "the store to take puts again")
    client.reset_caches(device_only=True)
    got = client.complete(fresh, [9], max_new_tokens=6, recompute_ratio=RATIO, stop_token_ids=[])
    assert got.stats.chunk_tokens_by_tier == {"dram": 96}, got.stats
    assert list(got.token_ids) == expect(reference, fresh, [9], 6)


def test_store_down_means_computing_until_it_is_back(tiny_model, reference, tmp_path):
    """Deterministic twin of the test above, in this process: the shard is down until we restart it."""
    from services.kvstore import BackgroundServer, StoreConfig

    from tests.helpers import InProcessCluster

    inproc = InProcessCluster(tiny_model, tmp_path)
    try:
        with Client(inproc.address, timeout=60) as c:
            chunks = docs(2, 40, seed=400)
            assert all(r.stored for r in c.register_chunks(chunks))
            port = inproc.store.port
            inproc.store.stop()
            for suffix in ([1], [2]):            # the second finds the shard backing off: no wait either
                c.reset_caches(device_only=True)
                got = c.complete(chunks, suffix, max_new_tokens=5, recompute_ratio=RATIO, stop_token_ids=[])
                assert got.stats.chunk_tokens_by_tier == {"computed": 80}, got.stats
                assert list(got.token_ids) == expect(reference, chunks, suffix, 5)
            from services.cluster.security import ClusterTLS

            inproc.store = BackgroundServer(StoreConfig(dram_bytes=64 << 20), port=port,     # back, empty
                                            tls=ClusterTLS.load(inproc.certs, "store"))
            fresh = docs(2, 40, seed=401)
            wait_until(lambda: all(r.stored for r in c.register_chunks(fresh)), 30, 0.5, "puts to the new shard")
            c.reset_caches(device_only=True)
            got = c.complete(fresh, [3], max_new_tokens=5, recompute_ratio=RATIO, stop_token_ids=[])
            assert got.stats.chunk_tokens_by_tier == {"dram": 80}, got.stats
            assert list(got.token_ids) == expect(reference, fresh, [3], 5)
    finally:
        inproc.stop()


def test_killed_gateway_returns_on_its_address_knowing_registered_ids(cluster, local_ray, client, reference):
    from services.launch.on_ray import GATEWAY_NAME

    chunks = docs(1, 30, seed=500)
    [reg] = client.register_chunks(chunks)
    old_pid = kill(cluster, local_ray, GATEWAY_NAME)
    wait_restarted(cluster, local_ray, client, GATEWAY_NAME, old_pid)    # the same client, the same address
    got = client.complete([ChunkId(reg.chunk_id)], [1], max_new_tokens=4, recompute_ratio=RATIO, stop_token_ids=[])
    assert list(got.token_ids) == expect(reference, chunks, [1], 4)
