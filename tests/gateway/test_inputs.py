"""The gateway's input resolution: token ids checked by numpy and passed on as given, chunk texts tokenized once."""

from __future__ import annotations

import pytest

from services.gateway.inputs import ChunkRegistry, InputResolver, InvalidRequest, TextTokens
from services.rpc import tessera_pb2 as pb


@pytest.fixture()
def resolver(tiny_model):
    return InputResolver(tiny_model, "fp", ChunkRegistry(), TextTokens(max_tokens=128))


def _text_request(*texts: str, suffix: str = "?") -> pb.GenerateRequest:
    return pb.GenerateRequest(chunks=[pb.ChunkInput(text=t) for t in texts], suffix_text=suffix)


def test_a_chunk_text_is_tokenized_once(resolver):
    req = _text_request("Paris is the capital of France. ", "Rome is in Italy. ")
    assert resolver.tokenizes(req.chunks)       # new texts: the gateway resolves them off its event loop
    first = resolver.resolve(req)
    assert not resolver.tokenizes(req.chunks)
    assert resolver.text_cache.misses == 2 and resolver.text_cache.hits == 0
    again = resolver.resolve(_text_request("Rome is in Italy. ", "Paris is the capital of France. ", suffix="Why?"))
    assert resolver.text_cache.hits == 2 and len(resolver.text_cache) == 2       # the suffixes are never kept
    assert [list(c) for c in again.chunks] == [list(c) for c in reversed(first.chunks)]
    assert again.chunk_ids == tuple(reversed(first.chunk_ids))
    want = resolver.tokenizer.encode("Rome is in Italy. ", add_special_tokens=False).ids
    assert list(again.chunks[0]) == want and again.chunk_ids[0] == resolver.chunk_id(want)
    # a new text beside a known one, and the same new text twice: tokenized once, as the tokenizer alone does
    third = resolver.resolve(_text_request("Bern is in Switzerland. ", "Rome is in Italy. ", "Bern is in Switzerland. "))
    assert resolver.text_cache.misses == 3 and resolver.text_cache.hits == 4
    assert list(third.chunks[0]) == list(third.chunks[2]) == resolver.tokenizer.encode(
        "Bern is in Switzerland. ", add_special_tokens=False).ids


def test_a_request_of_new_texts_is_tokenized_as_one_batch(resolver):
    texts = ["Oslo is in Norway. ", "Lima is in Peru. ", "Oslo is in Norway. "]
    got = resolver.resolve(_text_request(*texts))
    assert resolver.text_cache.misses == 2 and resolver.text_cache.hits == 0   # the repeat: from the same batch
    assert [list(c) for c in got.chunks] == [resolver.tokenizer.encode(t, add_special_tokens=False).ids for t in texts]


def test_the_text_cache_keeps_its_budget_least_recently_used_first():
    cache = TextTokens(max_tokens=10)
    cache.put("a", [1, 2, 3, 4])
    cache.put("b", [5, 6, 7, 8])
    assert list(cache.get("a")) == [1, 2, 3, 4]          # a is now the most recently used
    cache.put("c", [9, 10, 11])                          # 11 tokens: b goes
    assert cache.get("b") is None and list(cache.get("c")) == [9, 10, 11] and cache.tokens == 7
    assert list(cache.put("big", list(range(11)))) == list(range(11)) and cache.get("big") is None  # past the budget
    off = TextTokens(max_tokens=0)
    assert list(off.put("a", [1])) == [1] and off.get("a") is None and len(off) == 0
    with pytest.raises(ValueError, match="max_tokens"):
        TextTokens(max_tokens=-1)


def test_token_ids_are_checked_and_passed_on_as_given(resolver):
    req = pb.GenerateRequest(chunks=[pb.ChunkInput(tokens=pb.TokenIds(ids=[5, 6, 7]))],
                             suffix_tokens=pb.TokenIds(ids=[8]))
    got = resolver.resolve(req)
    assert list(got.chunks[0]) == [5, 6, 7] and list(got.suffix) == [8]
    assert got.chunk_ids[0] == resolver.chunk_id([5, 6, 7])
    vocab = resolver.cfg.vocab_size
    bad = pb.GenerateRequest(chunks=[pb.ChunkInput(tokens=pb.TokenIds(ids=[5, vocab, -3]))],
                             suffix_tokens=pb.TokenIds(ids=[8]))
    with pytest.raises(InvalidRequest, match=f"token id {vocab} in chunk 0 is outside the vocabulary"):
        resolver.resolve(bad)
    registry = ChunkRegistry()
    registry.add("cid", req.chunks[0].tokens.ids)          # the registry keeps its own copy, not the message's field
    assert registry.get("cid") == ("", (5, 6, 7))          # (namespace, token ids)


def test_the_cluster_config_refuses_a_negative_text_cache(tiny_model):
    from services.cluster.config import ClusterConfig

    assert ClusterConfig(model_dir=tiny_model, text_cache_tokens=0).text_cache_tokens == 0  # off is allowed
    with pytest.raises(ValueError, match="text_cache_tokens must be >= 0"):
        ClusterConfig(model_dir=tiny_model, text_cache_tokens=-1)


def test_the_gateway_names_chunks_as_the_engine_does_without_torch(tiny_model, reference):
    """The gateway hashed chunk ids through the engine's chunk cache, which loads torch: the same ids now come
    from numpy alone, in every namespace."""
    import subprocess
    import sys

    from services.engine.kv.chunk_ids import scoped_id

    probe = ("import sys, json\n"
             "from services.gateway.inputs import ChunkRegistry, InputResolver\n"
             f"r = InputResolver({tiny_model!r}, {reference.fingerprint!r}, ChunkRegistry())\n"
             "print(json.dumps([r.chunk_id([5, 6, 7]), r.chunk_id((1,), 'tenant/acme'), 'torch' in sys.modules]))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    plain, scoped, torch_loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert plain == reference.chunk_id([5, 6, 7])
    assert scoped == scoped_id("tenant/acme", reference.chunk_id([1])) == reference.chunk_id([1], "tenant/acme")
    assert not torch_loaded


def _decode_request(**policy) -> pb.GenerateRequest:
    req = _text_request("Paris is the capital of France. ")
    req.decode.CopyFrom(pb.DecodePolicy(**policy))
    return req


@pytest.mark.parametrize("policy, reason", [
    (dict(name="sparse"), "decode must be one of dense, quest, retro, retrieval, got 'sparse'"),
    (dict(name="retro", retro_window=0), "retro_window must be in 1..16, got 0"),
    (dict(name="retro", retro_window=17), "retro_window must be in 1..16, got 17"),
    (dict(name="quest", retro_window=2), "decode 'quest' takes no retro_window"),
    (dict(name="", retro_window=2), "decode 'dense' takes no retro_window"),
    (dict(name="dense", budget_tokens=64, retro_window=2), "decode 'dense' takes no budget_tokens or retro_window"),
    (dict(name="retro", budget_tokens=0), "budget_tokens must be at least 1"),
    (dict(name="retro", dense_layers=4), "dense_layers must leave a sparse layer of the model's 4 for retro"),
    (dict(name="retrieval", retrieval_k=70000), "retrieval_k must be in 0..65536, got 70000"),
    (dict(name="retrieval", budget_tokens=64), "decode 'retrieval' takes no budget_tokens"),
    (dict(name="quest", sink_tokens=4), "decode 'quest' takes no sink_tokens"),
], ids=["unknown", "window-0", "window-17", "quest-window", "default-window", "dense-params", "retro-budget",
        "retro-dense-layers", "retrieval-k-big", "retrieval-budget", "quest-sink"])
def test_a_bad_decode_policy_is_refused_before_any_text_is_tokenized(resolver, policy, reason):
    with pytest.raises(InvalidRequest, match=reason):
        resolver.resolve(_decode_request(**policy))
    assert resolver.text_cache.misses == 0 and len(resolver.text_cache) == 0    # nothing tokenized, nothing kept


def test_a_retro_policy_is_passed_on_as_given(resolver):
    got = resolver.resolve(_decode_request(name="retro", budget_tokens=32, dense_layers=1, retro_window=16))
    assert got.decode == pb.DecodePolicy(name="retro", budget_tokens=32, dense_layers=1, retro_window=16)
    # unset parameters stay unset: the engine's defaults
    assert resolver.resolve(_decode_request(name="retro")).decode == pb.DecodePolicy(name="retro")
    assert resolver.resolve(_decode_request(name="dense")).decode is None
    got = resolver.resolve(_decode_request(name="retrieval", retrieval_k=7, sink_tokens=0, window_tokens=64))
    assert got.decode == pb.DecodePolicy(name="retrieval", retrieval_k=7, sink_tokens=0, window_tokens=64)


def test_the_gateway_knows_the_engines_decode_parameters():
    """services/modes.py's parameters per policy and retro's largest window are the engine's policies' own."""
    import dataclasses

    from services.engine.decode import POLICIES
    from services.engine.decode.retro import MAX_WINDOW
    from services.modes import DECODE_PARAMS, MAX_RETRO_WINDOW

    assert {name: tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else ()
            for name, cls in POLICIES.items()} == DECODE_PARAMS
    assert MAX_RETRO_WINDOW == MAX_WINDOW
