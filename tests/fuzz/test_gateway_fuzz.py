"""Fuzzing the client API over gRPC (``tessera.v1.Tessera``: Generate, RegisterChunks, Stats, ResetCaches).

Raw protobuf messages built by hypothesis go to a gateway, prefill and decode worker and store shard served in
this process (``InProcessCluster``, with a bearer token): chunks as text, token ids or chunk ids (registered
ones and random ones), suffixes, sampling values out of range, NaN and infinities, unknown modes, empty fields,
long strings, prompts at the model's length limit, short deadlines and streams cancelled mid-way, calls with
random metadata instead of the token.

Property: every call ends with a status among INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAUTHENTICATED,
PERMISSION_DENIED, NOT_FOUND, DEADLINE_EXCEEDED or OK (never UNKNOWN, never INTERNAL for client input), and its
message shows no Python traceback or exception class; a valid request is served within its limits; after the
whole run the workers still serve: a fixed greedy request returns the same tokens as before it.
"""

from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.inputs import MODES
from services.rpc import tessera_pb2 as pb
from services.rpc import tessera_pb2_grpc as pb_grpc
from tests.helpers import MAX_POSITIONS

from .common import FUZZ, expect, leaked_traceback
from .conftest import TOKEN

pytestmark = pytest.mark.slow

CLEAR = {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAUTHENTICATED", "PERMISSION_DENIED", "NOT_FOUND",
         "DEADLINE_EXCEEDED"}
VOCAB = 320                 # the tests' tiny model (services/engine/model/tiny.py)
METADATA = (("authorization", f"Bearer {TOKEN}"),)
FIXED = pb.GenerateRequest(chunks=[pb.ChunkInput(tokens=pb.TokenIds(ids=[1, 2, 3, 4])), pb.ChunkInput(text="The cat sat. ")],
                           suffix_tokens=pb.TokenIds(ids=[5, 6]), sampling=pb.SamplingParams(max_new_tokens=8))


class Api:
    """A raw stub of the gateway, the chunk ids registered up front, and the fixed request's tokens then."""

    def __init__(self, cluster) -> None:
        self.channel = grpc.insecure_channel(cluster.address, options=[("grpc.max_send_message_length", 16 << 20)])
        self.stub = pb_grpc.TesseraStub(self.channel)
        reply = self.stub.RegisterChunks(pb.RegisterChunksRequest(chunks=[
            pb.ChunkInput(text="Paris is the capital of France. " * 3), pb.ChunkInput(tokens=pb.TokenIds(ids=list(range(40))))]),
            metadata=METADATA, timeout=60)
        self.chunk_ids = [c.chunk_id for c in reply.chunks]
        self.baseline = self.fixed_tokens()
        assert len(self.baseline) == 8

    def fixed_tokens(self) -> list[int]:
        return [t for m in self.stub.Generate(FIXED, metadata=METADATA, timeout=60) for t in m.token_ids]

    def generate(self, req: pb.GenerateRequest, timeout: float = 60, metadata=METADATA):
        """(code name, details, the streamed messages)."""
        messages = []
        try:
            for m in self.stub.Generate(req, metadata=metadata, timeout=timeout):
                messages.append(m)
            return "OK", "", messages
        except grpc.RpcError as exc:
            return exc.code().name, exc.details() or "", messages

    def unary(self, call):
        try:
            return "OK", "", call()
        except grpc.RpcError as exc:
            return exc.code().name, exc.details() or "", None


@pytest.fixture(scope="module")
def api(cluster):
    a = Api(cluster)
    yield a
    a.channel.close()


def assert_clear(code: str, details: str, req, *sent: str) -> None:
    assert code in CLEAR, f"{code} ({details}) for {req}"
    leak = leaked_traceback(details, *sent)
    assert leak is None, f"{code} message shows {leak!r}: {details}\nfor {req}"


def strings_of(req: pb.GenerateRequest) -> list[str]:
    """The text a refusal may quote back."""
    out = [req.mode, req.request_id, req.suffix_text]
    return out + [c.text or c.chunk_id for c in req.chunks] + [c.namespace for c in req.chunks]


# ---------------------------------------------------------------------------------------------- requests
def mostly(good, bad):
    return st.one_of(good, good, good, bad)


FLOAT32 = st.floats(width=32) | st.sampled_from([1e-45, -1e-45, 3.4e38, -3.4e38, math.nan, math.inf, -math.inf, -0.0])
UNIT = st.floats(0, 1, width=32) | st.sampled_from([0.0, 1.0, 1e-45, 0.99999994])
TOKEN_ID = mostly(st.integers(0, VOCAB - 1), st.integers(-(2**31), 2**31 - 1) | st.sampled_from([VOCAB, -1, 2**31 - 1]))
IDS = st.lists(TOKEN_ID, max_size=12) | st.lists(st.integers(0, VOCAB - 1), max_size=700)
TEXT = st.one_of(st.text(max_size=200), st.text(st.characters(codec="utf-8"), max_size=60),
                 st.sampled_from(["\x00", " ", "\r\n\t", "🙂" * 50, "é" * 300, "x" * 100_000, "y" * (9 << 20)]))
SAMPLING = st.builds(
    lambda t, p, k, seed, n, stops, ie: pb.SamplingParams(temperature=t, top_p=p, top_k=k, seed=seed, max_new_tokens=n,
                                                          stop_token_ids=stops, ignore_eos=ie),
    mostly(st.sampled_from([0.0, 0.0, 0.7, 1e-45, 3.4e38]) | st.floats(0, 10, width=32), FLOAT32),
    mostly(UNIT, FLOAT32),
    mostly(st.integers(0, 400) | st.sampled_from([2**31 - 1]), st.integers(-(2**31), -1)),
    st.none() | st.integers(0, 2**64 - 1) | st.sampled_from([0, 2**63, 2**64 - 1]),
    st.sampled_from([0, 1, 2, 16, MAX_POSITIONS, 2**31, 2**32 - 1]) | st.integers(0, 16),
    st.lists(TOKEN_ID, max_size=5), st.booleans())


def build(chunks, suffix, sampling, mode, ratio, request_id) -> pb.GenerateRequest:
    req = pb.GenerateRequest(chunks=chunks, sampling=sampling, mode=mode, request_id=request_id)
    if isinstance(suffix, str):
        req.suffix_text = suffix
    elif suffix is not None:
        req.suffix_tokens.ids.extend(suffix)
    if ratio is not None:
        req.recompute_ratio = ratio
    return req


NAMESPACE = mostly(st.just(""), st.text(max_size=12) | st.just("public"))     # none is shared without tenants


def any_request(chunk_ids):
    chunk = st.one_of(st.builds(lambda t, ns: pb.ChunkInput(text=t, namespace=ns), TEXT, NAMESPACE),
                      st.builds(lambda i, ns: pb.ChunkInput(tokens=pb.TokenIds(ids=i), namespace=ns), IDS, NAMESPACE),
                      st.builds(lambda c, ns: pb.ChunkInput(chunk_id=c, namespace=ns),
                                mostly(st.sampled_from(chunk_ids), st.text(max_size=70)), NAMESPACE),
                      st.builds(lambda ns: pb.ChunkInput(namespace=ns), NAMESPACE))
    return st.builds(build, st.lists(chunk, max_size=6), st.none() | TEXT | IDS, SAMPLING,
                     mostly(st.sampled_from(["", *MODES]), st.text(max_size=20)), mostly(st.none() | UNIT, FLOAT32),
                     st.text(max_size=40) | st.sampled_from(["x" * 5000, "../..", "a\x00b"]))


VALID_TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=150) | st.sampled_from([" ", "\x00", "🙂" * 20])
VALID_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40) | st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                                                                     max_size=400)
VALID_SAMPLING = st.builds(
    lambda t, p, k, seed, n, stops, ie: pb.SamplingParams(temperature=t, top_p=p, top_k=k, seed=seed, max_new_tokens=n,
                                                          stop_token_ids=stops, ignore_eos=ie),
    st.sampled_from([0.0, 0.0, 0.7, 1e-45, 1e-30, 3.4e38, 100.0]) | st.floats(0, 10, width=32),
    st.floats(1.401298464324817e-45, 1, width=32) | st.sampled_from([0.0, 1.0]),
    st.integers(0, 400) | st.sampled_from([2**31 - 1]), st.none() | st.integers(0, 2**64 - 1),
    st.integers(0, 12), st.lists(st.integers(0, VOCAB - 1), max_size=5), st.booleans())


def valid_request(chunk_ids):
    chunk = st.one_of(st.builds(lambda t: pb.ChunkInput(text=t), VALID_TEXT),
                      st.builds(lambda i: pb.ChunkInput(tokens=pb.TokenIds(ids=i)), VALID_IDS),
                      st.builds(lambda c: pb.ChunkInput(chunk_id=c), st.sampled_from(chunk_ids)))
    return st.builds(build, st.lists(chunk, max_size=6), st.none() | VALID_TEXT | VALID_IDS, VALID_SAMPLING,
                     st.sampled_from(["", *MODES]), st.none() | st.floats(0, 1, width=32) | st.sampled_from([0.0, 1.0]),
                     st.text(max_size=20))


@st.composite
def at_the_limit(draw):
    """A prompt of exactly MAX_POSITIONS - n tokens, cut into chunks at random, asking for n new tokens."""
    n = draw(st.integers(1, 4))
    total = MAX_POSITIONS - n
    ids = [(i * 7919) % VOCAB for i in range(total)]
    cuts = sorted(set(draw(st.lists(st.integers(1, total - 1), max_size=6))))
    parts = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, total])]
    seed = draw(st.none() | st.integers(0, 99))
    req = pb.GenerateRequest(mode=draw(st.sampled_from(MODES)), sampling=pb.SamplingParams(
        max_new_tokens=n, ignore_eos=True, temperature=0.0 if seed is None else 1.0, seed=seed))
    *chunks, last = parts
    req.chunks.extend(pb.ChunkInput(tokens=pb.TokenIds(ids=p)) for p in chunks)
    if draw(st.booleans()):
        req.suffix_tokens.ids.extend(last)
    else:
        req.chunks.append(pb.ChunkInput(tokens=pb.TokenIds(ids=last)))      # chunks only: the last token is the suffix
    if draw(st.booleans()):
        req.recompute_ratio = draw(st.floats(0, 1, width=32))
    return req


# ---------------------------------------------------------------------------------------------- properties
def test_generate_ends_clearly_for_any_request(api):
    @settings(FUZZ, max_examples=200)
    @given(any_request(api.chunk_ids))
    def call(req):
        code, details, _ = api.generate(req)
        assert_clear(code, details, req, *strings_of(req))

    call()
    assert api.fixed_tokens() == api.baseline


def test_a_valid_request_is_served_within_its_limits(api):
    @settings(FUZZ, max_examples=100)
    @given(st.one_of(valid_request(api.chunk_ids), valid_request(api.chunk_ids), at_the_limit()))
    def call(req):
        code, details, messages = api.generate(req)
        assert_clear(code, details, req, *strings_of(req))
        if code != "OK":
            assert code == "INVALID_ARGUMENT" and ("past the model's limit" in details or "empty request" in details), \
                f"a valid request was refused: {code} {details}\n{req}"
            return
        tokens = [t for m in messages for t in m.token_ids]
        asked = req.sampling.max_new_tokens or 16
        last = messages[-1]
        assert last.finish_reason in ("stop", "length") and last.HasField("stats"), f"the stream's end: {last}"
        assert all(0 <= t < VOCAB for t in tokens) and 1 <= len(tokens) <= asked, f"{len(tokens)} tokens for {asked}"
        if last.finish_reason == "length":
            assert len(tokens) == asked
        else:
            assert not req.sampling.ignore_eos or tokens[-1] in req.sampling.stop_token_ids
        assert last.stats.output_tokens == len(tokens)

    call()
    assert api.fixed_tokens() == api.baseline


def test_register_chunks_ends_clearly(api):
    chunk = st.one_of(st.builds(lambda t: pb.ChunkInput(text=t), TEXT | VALID_TEXT),
                      st.builds(lambda i: pb.ChunkInput(tokens=pb.TokenIds(ids=i)), IDS | VALID_IDS),
                      st.builds(lambda c: pb.ChunkInput(chunk_id=c), st.sampled_from(api.chunk_ids) | st.text(max_size=10)),
                      st.just(pb.ChunkInput()))

    @settings(FUZZ, max_examples=80)
    @given(st.lists(chunk, max_size=6))
    def call(chunks):
        req = pb.RegisterChunksRequest(chunks=chunks)
        code, details, reply = api.unary(lambda: api.stub.RegisterChunks(req, metadata=METADATA, timeout=60))
        assert_clear(code, details, req, *[c.text or c.chunk_id for c in chunks])
        if code == "OK":
            assert len(reply.chunks) == len(chunks) and all(c.chunk_id and c.num_tokens >= 1 for c in reply.chunks)

    call()
    assert api.fixed_tokens() == api.baseline


def test_stats_and_reset_caches_end_clearly(api):
    @settings(FUZZ, max_examples=12)
    @given(st.booleans(), st.binary(max_size=12))
    def call(device_only, unknown_fields):
        # unknown fields (a newer client's) are skipped by protobuf: the calls read as usual
        reset = pb.ResetCachesRequest(device_only=device_only)
        reset.MergeFromString(b"\x7a" + bytes([len(unknown_fields)]) + unknown_fields)       # field 15, bytes
        code, details, _ = api.unary(lambda: api.stub.ResetCaches(reset, metadata=METADATA, timeout=60))
        assert_clear(code, details, reset)
        code, details, stats = api.unary(lambda: api.stub.Stats(pb.StatsRequest(), metadata=METADATA, timeout=60))
        assert code == "OK", details
        assert stats.vocab_size == VOCAB and all(w.healthy for w in stats.workers)

    call()
    assert api.fixed_tokens() == api.baseline


METHODS = ["Generate", "RegisterChunks", "Stats", "ResetCaches"]


def test_a_call_without_the_token_is_unauthenticated(api):
    header = st.text(st.characters(codec="ascii", categories=["Ll", "Nd"], include_characters="-_."), min_size=1,
                     max_size=16).filter(lambda k: not k.startswith("grpc-") and not k.endswith("-bin"))
    value = st.text(st.characters(codec="ascii", min_codepoint=32, max_codepoint=126), max_size=30)
    metadata = st.lists(st.tuples(header | st.just("authorization"),
                                  value | st.sampled_from(["Bearer", "Bearer ", f"bearer {TOKEN}", f"Bearer {TOKEN} ",
                                                           f"Basic {TOKEN}", TOKEN, f"Bearer {TOKEN}x"])), max_size=3)

    @settings(FUZZ, max_examples=60)
    @given(metadata, st.sampled_from(METHODS))
    def call(md, method):
        if method == "Generate":
            code, details, _ = api.generate(pb.GenerateRequest(suffix_text="hi"), metadata=md)
        else:
            req = {"RegisterChunks": pb.RegisterChunksRequest(chunks=[pb.ChunkInput(text="zz")]),
                   "Stats": pb.StatsRequest(), "ResetCaches": pb.ResetCachesRequest(device_only=True)}[method]
            code, details, _ = api.unary(lambda: getattr(api.stub, method)(req, metadata=md, timeout=60))
        assert_clear(code, details, md)
        authorized = dict(md).get("authorization") == f"Bearer {TOKEN}"
        assert (code != "UNAUTHENTICATED") == authorized, f"{method} with {md}: {code} {details}"

    call()


def test_a_short_deadline_or_a_cancelled_stream_leaves_the_workers_serving(api):
    @settings(FUZZ, max_examples=60)
    @given(valid_request(api.chunk_ids), st.floats(0.001, 0.3), st.integers(0, 4), st.sampled_from([None, True, False]))
    def call(req, timeout, keep, reset):
        stream = api.stub.Generate(req, metadata=METADATA, timeout=timeout)
        try:
            for i, _ in enumerate(stream):
                if i >= keep:
                    stream.cancel()           # the client leaves mid-stream
                    break
            code, details = "OK", ""
        except grpc.RpcError as exc:
            code, details = exc.code().name, exc.details() or ""
        if code != "CANCELLED":               # CANCELLED: by this client, above
            assert_clear(code, details, req, *strings_of(req))
        if reset is not None:
            code, details, _ = api.unary(lambda: api.stub.ResetCaches(pb.ResetCachesRequest(device_only=reset),
                                                                      metadata=METADATA, timeout=60))
            assert code == "OK", details

    call()
    assert api.fixed_tokens() == api.baseline


# ---------------------------------------------------------------------------------------------- bytes that are not a message
def test_a_request_that_is_not_protobuf_is_invalid_argument(api):
    raw = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
    got = {}
    for method in METHODS:
        kind = api.channel.unary_stream if method == "Generate" else api.channel.unary_unary
        call = kind(f"/tessera.v1.Tessera/{method}", **raw)
        for body in (b"\xff", b"\x0a"):                      # a bad tag; a field cut short
            try:
                result = call(body, metadata=METADATA, timeout=30)
                list(result) if method == "Generate" else result
                got[method, body] = ("OK", None)
            except grpc.RpcError as exc:
                got[method, body] = (exc.code().name, leaked_traceback(exc.details() or ""))
    expect(got == dict.fromkeys(got, ("INVALID_ARGUMENT", None)), f"(status, traceback text shown): {got}")


def test_the_workers_serve_the_fixed_request_as_before_the_run(api):
    """Last in the module: after every call above, the same greedy request gives the same tokens."""
    assert api.fixed_tokens() == api.baseline
    code, details, stats = api.unary(lambda: api.stub.Stats(pb.StatsRequest(), metadata=METADATA, timeout=60))
    assert code == "OK" and all(w.healthy for w in stats.workers), details
