"""Adversarial requests against services run in this process: none stops a worker, none reads or
changes what it should not."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.sdk import Client

from .helpers import docs


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
