"""The SDK refuses what a request cannot carry before sending it; streamed text is detokenized
incrementally (no character broken across messages, nothing repeated on resume); /metrics only."""

from __future__ import annotations

import asyncio
import math
import urllib.error
import urllib.request

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from services.gateway.detok import Detokenizer
from services.sdk import AsyncClient, ChunkId, Client, InvalidArgument, TesseraError

from tests.helpers import docs

TEXT = "héllo 世界 🙂, naïve café"


# ---------------------------------------------------------------------------------------------- SDK
@pytest.fixture(scope="module")
def nowhere():
    """An address nothing listens on: a refusal there (not UNAVAILABLE) was made before sending."""
    from services.cluster.serving import free_port

    return f"127.0.0.1:{free_port()}"


GOOD = dict(chunks=[[1, 2]], suffix=[3])

BAD_GENERATE = [
    (dict(chunks=[[1, 2**40]]), "token id 1099511627776 in chunk 0"),
    (dict(chunks=[[1, 3.7]]), "chunk 0: token 1 must be an integer, got 3.7"),
    (dict(chunks=[[1, 3.0]]), "chunk 0: token 1 must be an integer"),
    (dict(chunks=[[True, 2]]), "chunk 0: token 0 must be an integer, got True"),
    (dict(chunks=[["7", 2]]), "chunk 0: token 0 must be an integer, got '7'"),
    (dict(chunks=[[-1]]), "token id -1 in chunk 0"),
    (dict(chunks=[[1], 5]), "chunk 1 must be text, a sequence of token ids or a ChunkId"),
    (dict(chunks=[b"bytes"]), "chunk 0: give text as str"),
    (dict(chunks=["\ud800 lone surrogate"]), "chunk 0 is not valid text"),
    (dict(chunks=None), "chunks must be a list of chunks"),
    (dict(chunks=[{1, 2}]), "chunk 0 must be a sequence of token ids"),
    (dict(suffix=[2**31]), "token id 2147483648 in suffix"),
    (dict(suffix=[1.5]), "suffix: token 0 must be an integer"),
    (dict(suffix=7), "suffix must be a sequence of token ids"),
    (dict(seed=-1), "seed must be in [0, "),
    (dict(seed=2**64), "seed must be in [0, "),
    (dict(seed=1.5), "seed must be an integer"),
    (dict(seed="42"), "seed must be an integer"),
    (dict(temperature=math.nan), "temperature must be a finite number"),
    (dict(temperature=math.inf), "temperature must be a finite number"),
    (dict(temperature=1e39), "temperature must be a finite number"),      # inf as a float32
    (dict(temperature="0.7"), "temperature must be a number"),
    (dict(temperature=True), "temperature must be a number"),
    (dict(top_p=math.nan), "top_p must be a finite number"),
    (dict(top_p=1e-46), "top_p must be in (0, 1]"),                        # 0 as a float32: "unset"
    (dict(top_k=2**31), "top_k must be in ["),
    (dict(top_k=5.0), "top_k must be an integer"),
    (dict(max_new_tokens=2**32), "max_new_tokens must be in [1, "),
    (dict(max_new_tokens=8.0), "max_new_tokens must be an integer"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer"),
    (dict(recompute_ratio=math.nan), "recompute_ratio must be a finite number"),
    (dict(recompute_ratio="0.2"), "recompute_ratio must be a number"),
    (dict(stop_token_ids=[2**40]), "token id 1099511627776 in stop_token_ids"),
    (dict(stop_token_ids=[0.5]), "stop_token_ids: token 0 must be an integer"),
    (dict(stop_token_ids=3), "stop_token_ids must be a sequence of token ids"),
    (dict(mode=3), "mode must be a str"),
    (dict(request_id=12), "request_id must be a str"),
    (dict(timeout=0), "timeout must be a number of seconds > 0"),
    (dict(timeout=-1.0), "timeout must be a number of seconds > 0"),
    (dict(timeout=math.nan), "timeout must be a finite number"),
    (dict(timeout="5"), "timeout must be a number"),
    (dict(timeout=365 * 24 * 3600 + 1), "timeout must be at most one year (31536000 s), got 31536001"),
    (dict(timeout=1e10), "timeout must be at most one year"),              # past gRPC's int64-ns deadline
    (dict(temperature=10**400), "temperature must be a finite number, got 1000000000000000000000000000000000000000"
                                "... (401 characters)"),                    # too large for a float
    (dict(top_p=10**5000), "top_p must be a finite number, got an integer of more than 4300 digits"),
    (dict(chunks=[[10**5000]]), "token id an integer of more than 4300 digits in chunk 0"),
]
IDS = ["id-2**40", "id-float", "id-integral-float", "id-bool", "id-str", "id-negative", "chunk-int", "chunk-bytes",
       "chunk-surrogate", "chunks-none", "chunk-set", "suffix-2**31", "suffix-float", "suffix-int", "seed-negative",
       "seed-2**64", "seed-float", "seed-str", "temperature-nan", "temperature-inf", "temperature-float32-overflow",
       "temperature-str", "temperature-bool", "top_p-nan", "top_p-float32-zero", "top_k-2**31", "top_k-float",
       "max_new_tokens-2**32", "max_new_tokens-float", "max_new_tokens-bool", "ratio-nan", "ratio-str",
       "stop-2**40", "stop-float", "stop-int", "mode-int", "request_id-int", "timeout-zero", "timeout-negative",
       "timeout-nan", "timeout-str", "timeout-past-a-year", "timeout-1e10", "temperature-10**400",
       "top_p-10**5000", "id-10**5000"]


def _refused(info, field: str) -> None:
    assert isinstance(info.value, TesseraError) and info.value.code == "INVALID_ARGUMENT"
    assert field in str(info.value)


@pytest.mark.parametrize("kwargs, field", BAD_GENERATE, ids=IDS)
def test_generate_refuses_a_bad_value_before_sending(nowhere, kwargs, field):
    with Client(nowhere, retries=0, timeout=5) as c:
        with pytest.raises(InvalidArgument) as info:
            c.generate(**{**GOOD, **kwargs})            # refused at the call, before any iteration
        _refused(info, field)
        with pytest.raises(InvalidArgument) as info:
            c.complete(**{**GOOD, **kwargs})
        _refused(info, field)


@pytest.mark.parametrize("kwargs, field", BAD_GENERATE, ids=IDS)
def test_async_generate_refuses_a_bad_value_before_sending(nowhere, kwargs, field):
    async def run():
        async with AsyncClient(nowhere, retries=0, timeout=5) as c:
            with pytest.raises(InvalidArgument) as info:
                c.generate(**{**GOOD, **kwargs})
            _refused(info, field)

    asyncio.run(run())


BAD_OTHER = [
    (lambda c: c.register_chunks([[1, 2**40]]), "token id 1099511627776 in chunk 0"),
    (lambda c: c.register_chunks([[1, 2.5]]), "chunk 0: token 1 must be an integer"),
    (lambda c: c.register_chunks(7), "chunks must be a list of chunks"),
    (lambda c: c.register_chunks(["ok"], timeout=math.inf), "timeout must be a finite number"),
    (lambda c: c.reset_caches(device_only="yes"), "device_only must be True or False"),
    (lambda c: c.stats(timeout=-3), "timeout must be a number of seconds > 0"),
]
OTHER_IDS = ["register-2**40", "register-float", "register-int", "register-timeout", "reset-flag", "stats-timeout"]


@pytest.mark.parametrize("call, field", BAD_OTHER, ids=OTHER_IDS)
def test_other_calls_refuse_bad_values(nowhere, call, field):
    with Client(nowhere, retries=0, timeout=5) as c:
        with pytest.raises(InvalidArgument) as info:
            call(c)
        _refused(info, field)
        with pytest.raises(InvalidArgument, match="timeout must be"):
            c.wait_ready(timeout=math.nan)

    async def run():
        async with AsyncClient(nowhere, retries=0, timeout=5) as c:
            with pytest.raises(InvalidArgument) as info:
                await call(c)
            _refused(info, field)

    asyncio.run(run())


@pytest.mark.parametrize("kwargs, field", [
    (dict(address=7), "address must be host:port"),
    (dict(address="no-port"), "address must be host:port"),
    (dict(timeout=0), "timeout must be a number of seconds > 0"),
    (dict(timeout=math.nan), "timeout must be a finite number"),
    (dict(retries=-1), "retries must be in [0, "),
    (dict(retries=2.5), "retries must be an integer"),
    (dict(backoff_s=math.nan), "backoff_s must be a finite number"),
    (dict(backoff_s=-0.1), "backoff_s must be >= 0"),
    (dict(token=1234), "token must be a str"),
    (dict(token="sésame"), "token must be a str of printable ASCII"),
    (dict(tls=5), "tls must be None, True, a CA file path"),
    (dict(tls="/nonexistent/ca.pem"), "tls: cannot read the CA file"),
], ids=["address-int", "address-no-port", "timeout-zero", "timeout-nan", "retries-negative", "retries-float",
        "backoff-nan", "backoff-negative", "token-int", "token-non-ascii", "tls-int", "tls-missing-file"])
def test_clients_refuse_bad_settings(nowhere, kwargs, field):
    kwargs = {"address": nowhere, **kwargs}
    with pytest.raises(InvalidArgument) as info:
        Client(**kwargs)
    _refused(info, field)

    async def run():
        with pytest.raises(InvalidArgument) as info:
            AsyncClient(**kwargs)
        _refused(info, field)

    asyncio.run(run())


def test_chunk_id_must_be_text():
    with pytest.raises(InvalidArgument, match="ChunkId.id must be a str"):
        ChunkId(5)


def test_integer_like_values_are_sent_exactly():
    """numpy integers and floats are taken (as the values they hold), ints are never truncated."""
    np = pytest.importorskip("numpy")
    from services.sdk.types import generate_request

    req = generate_request([np.array([1, 2**31 - 1]), "text", ChunkId("c1")], (np.int32(4),),
                           max_new_tokens=np.int64(3), temperature=np.float32(0.5), top_p=1, top_k=np.int16(5),
                           seed=2**64 - 1, mode="tessera", recompute_ratio=0.25, stop_token_ids=[np.uint8(9)],
                           request_id=None)
    assert list(req.chunks[0].tokens.ids) == [1, 2**31 - 1] and req.chunks[1].text == "text"
    assert req.chunks[2].chunk_id == "c1" and list(req.suffix_tokens.ids) == [4]
    s = req.sampling
    assert (s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (3, 0.5, 1.0, 5, 2**64 - 1)
    assert list(s.stop_token_ids) == [9] and s.ignore_eos and req.recompute_ratio == 0.25


# ----------------------------------------------------------------------------------- detokenizer
def _bytes_to_symbols() -> dict[int, str]:
    """GPT-2's byte -> printable symbol map (what the ByteLevel pre-tokenizer and decoder use)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return symbols


def byte_bpe(pieces: list[bytes]) -> Tokenizer:
    """A byte-level BPE whose merges join the bytes of each of ``pieces``: tokens that start or end inside a
    character, as a trained byte-level vocabulary has."""
    sym = _bytes_to_symbols()
    assert set(sym.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate(sorted(sym.values()))}
    merges = []
    for piece in pieces:
        cur = sym[piece[0]]
        for b in piece[1:]:
            merges.append((cur, sym[b]))
            cur += sym[b]
            vocab.setdefault(cur, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def tokenizers_under_test():
    from services.engine.model.tiny import byte_tokenizer_json

    # é = C3 A9, 世 = E4 B8 96, 界 = E7 95 8C, 🙂 = F0 9F 99 82, ï = C3 AF
    merged = byte_bpe([b"\xa9l", b"\xb8\x96\xe7", b"\x9f\x99", b"o ", b"\xc3\xaf"])
    return {"byte-bpe-with-merges": merged, "tiny-model-bytes": Tokenizer.from_str(byte_tokenizer_json())}


@pytest.fixture(scope="module", params=["byte-bpe-with-merges", "tiny-model-bytes"])
def tok(request):
    return tokenizers_under_test()[request.param]


def test_streamed_text_is_whole_characters(tok):
    ids = tok.encode(TEXT).ids
    assert tok.decode(ids) == TEXT
    assert "\ufffd" in "".join(tok.decode([i]) for i in ids)      # decoded apart, characters break
    d = Detokenizer(tok)
    pieces = [d.push([i]) for i in ids] + [d.flush()]
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in p for p in pieces)
    # several tokens at a time: the same text
    d = Detokenizer(tok)
    assert "".join(d.push(ids[i:i + 3]) for i in range(0, len(ids), 3)) + d.flush() == TEXT


def test_a_resumed_detokenizer_repeats_nothing(tok):
    """An attempt that resumes after k tokens were sent rebuilds the state from them: the text held back
    (a character the k-th token left incomplete) comes once, after."""
    ids = tok.encode(TEXT).ids
    held = 0
    for k in range(len(ids) + 1):
        first = Detokenizer(tok)
        sent_text = "".join(first.push([i]) for i in ids[:k])
        resumed = Detokenizer(tok, ids[:k])
        held += resumed.read < k
        assert sent_text + resumed.push(ids[k:]) + resumed.flush() == TEXT, k
    assert held                                   # some cut fell inside a character


def test_text_left_incomplete_at_the_end_is_flushed(tok):
    ids = tok.encode("ok 世").ids
    d = Detokenizer(tok)
    streamed = d.push(ids[:-1])                   # the last byte of 世 never comes
    assert streamed == "ok "
    rest = d.flush()
    assert streamed + rest == tok.decode(ids[:-1]) and rest.endswith("\ufffd")
    assert d.flush() == ""


def test_no_tokenizer_means_no_text():
    d = Detokenizer(None, [1, 2])
    assert d.push([3]) == "" and d.flush() == ""


# ------------------------------------------------------------------------------ gateway streams
def _split_output(reference, tok, cut_inside: bool):
    """A request whose greedy output has characters split across tokens (decoded apart they differ);
    with ``cut_inside``, also a cut k (>= 2 tokens) after which text is held back."""
    for seed in range(200):
        chunks = docs(1, 16, seed=seed)
        ids = reference.generate(chunks, [1], max_new_tokens=16, stop_token_ids=[])
        if tok.decode(ids) == "".join(tok.decode([i]) for i in ids):
            continue
        cuts = [k for k in range(2, len(ids) - 2) if Detokenizer(tok, ids[:k]).read < k]
        if not cut_inside or cuts:
            return chunks, ids, (cuts[0] if cuts else None)
    raise AssertionError("no request found whose output splits a character")


def _tiny_tokenizer(reference) -> Tokenizer:
    return Tokenizer.from_file(f"{reference.model_dir}/tokenizer.json")


@pytest.mark.slow
def test_gateway_streams_text_that_adds_up_to_the_decode(inproc, reference):
    tok = _tiny_tokenizer(reference)
    chunks, ids, _ = _split_output(reference, tok, cut_inside=False)
    with Client(inproc.address, token=inproc.token, timeout=60) as c:
        events = list(c.generate(chunks, [1], max_new_tokens=16, stop_token_ids=[]))
    assert [t for ev in events for t in ev.token_ids] == ids
    assert "".join(ev.text for ev in events) == tok.decode(ids)


class _CutDecodeStub:
    """A decode stub whose first stream fails UNAVAILABLE after ``tokens`` tokens, as a worker that died."""

    def __init__(self, stub, tokens: int) -> None:
        self.stub, self.tokens = stub, tokens

    def Decode(self, request, timeout=None):
        return _CutCall(self.stub.Decode(request, timeout=timeout), self.tokens)


class _CutCall:
    def __init__(self, call, tokens: int) -> None:
        self.call, self.left = call, tokens

    def cancel(self) -> bool:
        return self.call.cancel()

    async def __aiter__(self):
        import grpc

        from services.rpc import tessera_pb2 as pb

        async for msg in self.call:
            if len(msg.token_ids) >= self.left:
                if self.left:
                    yield pb.DecodeResponse(token_ids=msg.token_ids[:self.left])
                self.call.cancel()
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           "the decode worker went away (test)")
            self.left -= len(msg.token_ids)
            yield msg


@pytest.mark.slow
def test_a_resumed_stream_repeats_no_text(tiny_model, inproc, reference):
    """The decode stream fails with a character half sent; the request resumes on another decode worker
    (here the same one under a second name): the text held back comes once, none is repeated."""
    from services.gateway.server import create_server

    tok = _tiny_tokenizer(reference)
    chunks, ids, k = _split_output(reference, tok, cut_inside=True)
    views = inproc.gateway.servicer.router.workers.values()
    prefill = next(w for w in views if w.role == "prefill")
    decode = next(w for w in views if w.role == "decode")
    workers = [(prefill.name, "prefill", prefill.address), ("decode-a", "decode", decode.address),
               ("decode-b", "decode", decode.address)]
    # the in-process workers may want the cluster's mutual TLS: this gateway calls them as the module's does
    tls = getattr(inproc, "cluster_tls", None)
    server, port = inproc.loop.run(create_server(tiny_model, workers, **({"cluster_tls": tls} if tls else {})))
    peers = server.servicer.peers
    real, cut = peers.decode_stub, []

    def decode_stub(w):
        if cut:
            return real(w)
        cut.append(w.name)
        return _CutDecodeStub(real(w), k - 1)          # the prefill worker sent token 0

    peers.decode_stub = decode_stub
    try:
        with Client(f"127.0.0.1:{port}", timeout=60) as c:
            events = list(c.generate(chunks, [1], max_new_tokens=16, stop_token_ids=[]))
    finally:
        inproc.loop.run(server.stop(0.1))
    assert cut                                          # the first decode stream was cut after k tokens
    assert [t for ev in events for t in ev.token_ids] == ids
    assert "".join(ev.text for ev in events) == tok.decode(ids)


# ---------------------------------------------------------------------------------------- metrics
@pytest.mark.slow
def test_metrics_server_answers_metrics_only():
    from prometheus_client import CollectorRegistry, Counter

    from services.cluster.serving import serve_metrics

    registry = CollectorRegistry()
    Counter("tessera_test_events_total", "events", registry=registry).inc(3)
    server, port = serve_metrics(registry, "127.0.0.1")
    assert server.server_port == port
    base = f"http://127.0.0.1:{port}"
    try:
        body = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
        assert "tessera_test_events_total 3.0" in body
        only = urllib.request.urlopen(f"{base}/metrics?name[]=tessera_test_events_total", timeout=10).read().decode()
        assert "tessera_test_events_total 3.0" in only
        for path in ("/", "/favicon.ico", "/metricsx", "/metrics/", "/admin"):
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(f"{base}{path}", timeout=10)
            assert info.value.code == 404, path
    finally:
        server.shutdown()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{base}/metrics", timeout=2)


def test_cluster_metrics_urls_answer_only_metrics(inproc):
    with Client(inproc.address, token=inproc.token, timeout=30) as c:
        st = c.stats()
    urls = [st.metrics_url] + [w.metrics_url for w in st.workers]
    assert len(urls) == 3 and all(u.endswith("/metrics") for u in urls)
    for url in urls:
        assert "tessera_" in urllib.request.urlopen(url, timeout=10).read().decode()
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(url.removesuffix("/metrics") + "/", timeout=10)
        assert info.value.code == 404
