"""Retrieval decode in the engine (services/engine/decode/retrieval.py): with ``retrieval_k`` covering every offloaded
key it is dense decoding (tokens equal, logits within fp32 tolerance) in every serving mode; the static set and the
offloaded keys partition what each layer shows; stats count keys scanned; mixed batches; the index set is dropped
when the sequence is released; bad parameters and a hand-off are refused with nothing kept. The index itself is
tested in tests/index."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.engine import Engine
from services.engine.options import EngineOptions
from services.engine.decode import DENSE, RetrievalDecode

from ..conftest import random_request

# small sets so that most of a ~100-token prompt is offloaded (the tiny model's pages are 16 tokens)
SMALL = dict(sink_tokens=4, window_tokens=8)


@pytest.mark.parametrize("mode", ["full", "tessera", "prefix"])
def test_retrieving_every_offloaded_key_generates_what_dense_does(tiny_dir, mode):
    eng = Engine.load(tiny_dir)
    chunks, suffix = random_request(41, lengths=(40, 27, 33), suffix_len=6)
    dense = eng.generate(chunks, suffix, max_new_tokens=8, stop_token_ids=[], mode=mode)
    stats = {}
    got = eng.generate(chunks, suffix, max_new_tokens=8, stop_token_ids=[], mode=mode, decode="retrieval",
                       retrieval_k=4096, stats=stats, **SMALL)
    assert got == dense
    assert stats["steps"] == 7 and 0 < stats["pages_read"] < stats["pages_visible"]
    assert stats["keys_scanned"] > 0 and stats["retrieval_seconds"] > 0


def test_logits_of_full_retrieval_steps_equal_dense_within_fp32(tiny_dir):
    eng = Engine.load(tiny_dir)
    chunks, suffix = random_request(42, lengths=(35, 50, 21), suffix_len=5)
    out = []
    for policy in (DENSE, RetrievalDecode(retrieval_k=10_000, **SMALL)):
        logits, seq = eng.prefill_sequence(chunks, suffix, decode=policy, extra_tokens=4)
        out.append(torch.stack([logits] + [eng.decode_step([seq], [t])[0] for t in (5, 9, 11, 2)]))
        eng.release(seq)
    torch.testing.assert_close(out[1], out[0], rtol=1e-5, atol=1e-5)


def test_kv_held_in_bfloat16_is_the_float32_kv_rounded_and_decodes_as_dense(tiny_dir):
    """``EngineOptions(index_host_dtype="bfloat16")``: every offloaded key and value the index set holds is the float32
    set's, rounded (services/index/half.py); full retrieval then generates what dense decoding does, its logits within
    the rounding's reach."""
    from services.index import half

    chunks, suffix = random_request(43, lengths=(35, 50, 21), suffix_len=5)
    policy = RetrievalDecode(retrieval_k=10_000, **SMALL)
    held, logits = {}, {}
    for dtype in ("float32", "bfloat16"):
        eng = Engine.load(tiny_dir, options=EngineOptions(index_host_dtype=dtype))
        first, seq = eng.prefill_sequence(chunks, suffix, decode=policy, extra_tokens=4)
        seq.offload.build.result(timeout=60)
        indexes = eng.forward.indexes
        assert indexes.host_dtype == dtype
        held[dtype] = {key: [(h.keys, h.values) for h in heads] for key, heads in indexes._heads.items()}
        held[dtype] = [held[dtype][(seq.offload.owner, layer)] for layer in range(eng.forward.cfg.num_layers)]
        logits[dtype] = torch.stack([first] + [eng.decode_step([seq], [t])[0] for t in (5, 9, 11, 2)])
        eng.release(seq)
        if dtype == "bfloat16":
            dense = eng.generate(chunks, suffix, max_new_tokens=8, stop_token_ids=[], mode="full")
            assert eng.generate(chunks, suffix, max_new_tokens=8, stop_token_ids=[], mode="full", decode="retrieval",
                                retrieval_k=4096, **SMALL) == dense
    for wide, narrow in zip(held["float32"], held["bfloat16"]):
        for (k32, v32), (k16, v16) in zip(wide, narrow):
            assert k16.dtype == v16.dtype == np.uint16 and k32.dtype == v32.dtype == np.float32
            np.testing.assert_array_equal(k16, half.to_bf16(k32))
            np.testing.assert_array_equal(v16, half.to_bf16(v32))
    # (seen: 0.018 at most, against logits up to 3.2: a key or value rounded by up to 2^-9 of itself)
    torch.testing.assert_close(logits["bfloat16"], logits["float32"], rtol=0, atol=5e-2)
    assert not torch.equal(logits["bfloat16"][1:], logits["float32"][1:])     # the rounding reached the steps


def test_the_copy_thread_ranks_each_training_querys_keys_where_the_keys_are(tiny_dir, monkeypatch):
    """The index set is handed each layer's exact lists (``exact_lists``: the keys ranked for every training query on
    the engine's device), which are faiss' lists over the keys it holds, and builds from them, not from its own."""
    from services.index import build
    from services.index.heads import IndexSet

    eng = Engine.load(tiny_dir)
    handed = []

    class Recording(IndexSet):
        def add(self, owner, layer, keys, values, train, chunks=(), lists=None):
            handed.append((np.array(keys), np.array(train), lists))
            return super().add(owner, layer, keys, values, train, chunks, lists)

    eng.forward.indexes = Recording(threads=1)
    chunks, suffix = random_request(44, lengths=(40, 37), suffix_len=5)
    searched = []
    real = build.exact_lists
    monkeypatch.setattr(build, "exact_lists", lambda keys, queries, *a: searched.append(queries.shape[0])
                        or real(keys, queries, *a))
    _, seq = eng.prefill_sequence(chunks, suffix, decode=RetrievalDecode(retrieval_k=4096, **SMALL))
    seq.offload.build.result(timeout=60)
    assert len(handed) == eng.forward.cfg.num_layers
    for keys, train, lists in handed:
        assert lists.dtype == np.int32 and lists.shape == train.shape[:2] + (min(100, keys.shape[1]),)
        for h in range(keys.shape[0]):
            want = real(keys[h], train[h], lists.shape[2], 1)
            assert all(set(g) == set(w) for g, w in zip(lists[h], want))
    # the host ranked keys for keys (a small graph's candidates), never for the training queries
    assert searched and not set(searched) & {train.shape[1] for _, train, _ in handed}
    eng.release(seq)


def test_the_static_set_and_the_offloaded_keys_partition_each_layer_and_only_the_static_set_stays(tiny_dir):
    """After offloading, each layer's table holds its static pages only; with what was offloaded they are every token
    of the prompt; the private blocks no layer keeps are back in the pool and the chunks no layer reads are unpinned."""
    eng = Engine.load(tiny_dir)
    chunks, suffix = random_request(43, lengths=(64, 48, 30), suffix_len=9)
    free = eng.pool.num_free
    _, dense = eng.prefill_sequence(chunks, suffix, extra_tokens=1)
    held_dense = free - eng.pool.num_free
    pinned_dense = len(dense.pinned)
    eng.release(dense)
    free = eng.pool.num_free
    _, seq = eng.prefill_sequence(chunks, suffix, decode=RetrievalDecode(**SMALL), extra_tokens=1)
    try:
        bs = eng.block_size
        # its K/V go to the host on the copy thread, the tables whole until then; the batcher's readiness check
        # (on the engine thread) cuts them once they are copied
        whole = sum(bin(m & ((1 << bs) - 1)).count("1") for m in seq.layer_tables[0].masks.tolist())
        assert whole == seq.next_pos                        # every token still shown
        assert seq.offload.copied.wait(60)
        assert seq.offload.cut is not None                  # not cut before the engine thread settles it
        seq.offload.build.result(timeout=60)
        assert seq.decode.ready(seq) and seq.offload.cut is None
        for layer, table in enumerate(seq.layer_tables):
            shown = sum(bin(m & ((1 << bs) - 1)).count("1") for m in table.masks.tolist())
            assert table.num_entries == seq.offload.static[layer] < -(-seq.next_pos // bs)
            assert shown + seq.offload.offloaded[layer] == seq.next_pos
        # the middle chunk shows no sink or window position: unpinned, evictable
        assert len(seq.pinned) < pinned_dense and all(e.refs == 0 for e in eng.cache._entries.values()
                                                      if e not in seq.pinned)
        assert len(seq.private_blocks) < held_dense
        eng.decode_step([seq], [7])                        # and it decodes from what it kept
    finally:
        eng.release(seq)
    assert eng.pool.num_free == free


def test_a_small_k_reads_fewer_keys_and_still_generates(tiny_dir):
    eng = Engine.load(tiny_dir)
    chunks, suffix = random_request(44, lengths=(60, 60), suffix_len=4)
    stats = {}
    out = eng.generate(chunks, suffix, max_new_tokens=5, stop_token_ids=[], mode="full", decode="retrieval",
                       retrieval_k=3, stats=stats, **SMALL)
    assert len(out) == 5 and stats["steps"] == 4 and stats["keys_scanned"] > 0


def test_a_mixed_batch_steps_each_sequence_as_alone(tiny_dir):
    eng = Engine.load(tiny_dir)
    reqs = [random_request(45 + i, lengths=(30 + 7 * i, 25), suffix_len=3) for i in range(3)]
    policies = [DENSE, RetrievalDecode(retrieval_k=5, **SMALL), RetrievalDecode(retrieval_k=10_000, **SMALL)]
    alone = []
    for (chunks, suffix), policy in zip(reqs, policies):
        _, seq = eng.prefill_sequence(chunks, suffix, decode=policy, extra_tokens=3)
        alone.append(torch.stack([eng.decode_step([seq], [t])[0] for t in (3, 4)]))
        eng.release(seq)
    seqs = [eng.prefill_sequence(c, s, decode=p, extra_tokens=3)[1] for (c, s), p in zip(reqs, policies)]
    together = torch.stack([eng.decode_step(seqs, [t] * 3) for t in (3, 4)], 1)
    for s in seqs:
        eng.release(s)
    for i in range(3):
        torch.testing.assert_close(together[i], alone[i], rtol=1e-5, atol=1e-5)


def test_releasing_the_sequence_drops_its_offloaded_kv(tiny_dir):
    eng = Engine.load(tiny_dir)
    chunks, suffix = random_request(48, lengths=(50,), suffix_len=4)
    free = eng.pool.num_free
    _, seq = eng.prefill_sequence(chunks, suffix, decode=RetrievalDecode(**SMALL))
    owner = seq.offload.owner
    seq.offload.build.result()
    assert owner in eng.forward.indexes and eng.forward.indexes.nbytes() > 0
    eng.release(seq)
    assert owner not in eng.forward.indexes and eng.forward.indexes.nbytes() == 0
    assert eng.pool.num_free == free - eng.cache.resident_bytes // eng.pool.block_bytes   # its chunks stay cached


@pytest.mark.parametrize("params, field", [(dict(retrieval_k=-1), "retrieval_k"), (dict(sink_tokens=-1), "sink_tokens"),
                                           (dict(window_tokens=1.5), "window_tokens")])
def test_bad_parameters_are_refused_by_name(tiny_dir, params, field):
    eng = Engine.load(tiny_dir)
    chunks, suffix = random_request(49, lengths=(20,), suffix_len=3)
    with pytest.raises(ValueError, match=field):
        eng.generate(chunks, suffix, max_new_tokens=2, decode="retrieval", **params)
    with pytest.raises(TypeError, match="budget_tokens"):
        eng.decode_policy("retrieval", budget_tokens=64)


def test_a_hand_off_without_the_prefill_queries_is_refused_clearly_and_keeps_nothing(tiny_dir):
    """Its offloaded keys are not all of chunks with graphs (the first and last chunks touch the static set): the
    rest needs the pass's queries."""
    eng = Engine.load(tiny_dir)
    chunks, suffix = random_request(50, lengths=(30, 20), suffix_len=3)
    _, handoff = eng.prefill_handoff(chunks, suffix)
    assert handoff.queries == ()
    before = eng.describe_memory()
    with pytest.raises(ValueError, match="tap_queries"):
        eng.import_handoff(handoff, decode=RetrievalDecode(**SMALL))
    assert eng.describe_memory() == before
    assert eng.forward.indexes is None or eng.forward.indexes.nbytes() == 0


def test_a_hand_off_with_its_queries_decodes_by_retrieval_on_another_engine_as_dense(tiny_dir):
    """The prefill engine taps its pass's queries into the hand-off (through its wire bytes); the decode engine builds
    its index from them; with every offloaded key retrieved, its steps equal a dense decode of the same hand-off."""
    from services.handoff.wire import Handoff

    a, b = Engine.load(tiny_dir), Engine.load(tiny_dir)
    chunks, suffix = random_request(52, lengths=(40, 33, 21), suffix_len=4)
    _, plain = a.prefill_handoff(chunks, suffix, extra_tokens=4)
    _, tapped = a.prefill_handoff(chunks, suffix, extra_tokens=4, tap_queries=True)
    assert len(tapped.queries) == a.cfg.num_layers and all(q.dtype == torch.float16 and q.shape[0] > 0
                                                            for q in tapped.queries)
    wire = Handoff.from_bytes(tapped.to_bytes())
    assert all(torch.equal(x, y) for x, y in zip(wire.queries, tapped.queries))
    fetch = lambda cid: iter(a.export_chunk(cid))  # noqa: E731
    out = []
    for h, policy in ((plain, DENSE), (wire, RetrievalDecode(retrieval_k=10_000, **SMALL))):
        seq = b.import_handoff(h, fetch=fetch, decode=policy)
        out.append(torch.stack([b.decode_step([seq], [t])[0] for t in (5, 9, 11)]))
        b.release(seq)
    torch.testing.assert_close(out[1], out[0], rtol=1e-5, atol=1e-5)


def test_a_decode_engine_uses_the_index_service_as_its_index_set(tiny_dir):
    """Through the service, dense decoding's tokens, and the K/V held there as many bytes as in process. (The
    service's bfloat16 wire and storage: tests/index/test_service.py.)"""
    from services.index import _layer
    from services.index.client import IndexClient
    from services.index.server import BackgroundIndexServer

    _layer.warm()               # compiled first: a compile in the service's background holds the GIL past deadlines
    eng = Engine.load(tiny_dir)
    chunks, suffix = random_request(51, lengths=(40, 37), suffix_len=5)
    dense = eng.generate(chunks, suffix, max_new_tokens=6, stop_token_ids=[])
    with BackgroundIndexServer(threads=1) as srv, IndexClient(srv.address) as client:
        eng.forward.indexes = client
        stats = {}
        _, seq = eng.prefill_sequence(chunks, suffix, decode=RetrievalDecode(retrieval_k=4096, **SMALL))
        seq.offload.build.result(timeout=60)
        cfg = eng.forward.cfg
        # every offloaded token's K and V, 4 bytes an element
        assert client.held()[1] == sum(seq.offload.offloaded) * cfg.num_kv_heads * cfg.head_dim * 2 * 4
        eng.release(seq)
        got = eng.generate(chunks, suffix, max_new_tokens=6, stop_token_ids=[], decode="retrieval", retrieval_k=4096,
                           stats=stats, **SMALL)
        assert got == dense and stats["keys_scanned"] > 0
        assert client.held()[0] == 0                      # released: dropped from the service too


def test_a_sequence_steps_while_the_index_service_builds_its_indexes(tiny_dir):
    """Through the service, as in process: the copy thread sends each layer's K/V at once (a hold), every search scans
    them whole until the builds, whose adds send no keys again, index them there; the logits are dense decoding's
    before the builds and after them, and the service holds the K/V once."""
    from services.index import _layer
    from services.index.client import IndexClient
    from services.index.server import BackgroundIndexServer

    _layer.warm()
    chunks, suffix = random_request(59, lengths=(40, 30), suffix_len=3)
    dense = Engine.load(tiny_dir)
    logits, seq = dense.prefill_sequence(chunks, suffix, decode=DENSE, extra_tokens=4)
    want = torch.stack([logits] + [dense.decode_step([seq], [t])[0] for t in (4, 7, 1, 9)])
    dense.release(seq)
    eng = Engine.load(tiny_dir)
    with BackgroundIndexServer(threads=1) as srv, IndexClient(srv.address, offload_timeout=300) as client:
        eng.forward.indexes = slow = _HeldIndexSet(client)
        logits, seq = eng.prefill_sequence(chunks, suffix, decode=RetrievalDecode(retrieval_k=4096, **SMALL),
                                           extra_tokens=4)
        for _ in range(600):                            # bounded: ready once every layer is held in the service
            if seq.decode.ready(seq):
                break
            seq.offload.copied.wait(0.1)
        assert seq.decode.ready(seq) and not seq.offload.build.done()
        offloaded = sum(seq.offload.offloaded) * eng.forward.cfg.num_kv_heads
        cfg = eng.forward.cfg
        kv_bytes, codes = client.held()[1:]                       # the K/V, and the keys' int8 codes (no graph yet)
        assert kv_bytes == offloaded * cfg.head_dim * 2 * 4
        got = [logits]
        for t in (4, 7):
            before = seq.decode_stats.keys_scanned
            got.append(eng.decode_step([seq], [t])[0])
            assert seq.decode_stats.keys_scanned - before == offloaded        # every key, scanned in the service
        slow.go.set()
        seq.offload.build.result(timeout=300)
        assert client.held()[1] == kv_bytes and client.held()[2] > codes      # indexed, the K/V held once
        got += [eng.decode_step([seq], [t])[0] for t in (1, 9)]
        eng.release(seq)
        assert client.held()[0] == 0
    torch.testing.assert_close(torch.stack(got), want, rtol=1e-5, atol=1e-5)


class _HeldIndexSet:
    """An index set whose adds wait for ``go`` (a slow build), around a real one: ``inner``, or a new ``IndexSet``."""

    def __init__(self, inner=None):
        import threading

        from services.index.heads import IndexSet

        self.inner, self.go = inner if inner is not None else IndexSet(threads=1), threading.Event()

    def add(self, *args):
        assert self.go.wait(60)
        return self.inner.add(*args)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __contains__(self, owner):
        return owner in self.inner


def test_a_sequence_whose_indexes_are_building_waits_and_others_step_meanwhile(tiny_dir):
    eng = Engine.load(tiny_dir, options=EngineOptions(decode_while_building=False))
    eng.forward.indexes = held = _HeldIndexSet()
    (c1, s1), (c2, s2) = random_request(53, lengths=(40, 30), suffix_len=3), random_request(54, lengths=(35,))
    _, slow = eng.prefill_sequence(c1, s1, decode=RetrievalDecode(retrieval_k=4096, **SMALL), extra_tokens=4)
    _, other = eng.prefill_sequence(c2, s2, extra_tokens=4)
    assert not slow.decode.ready(slow) and other.decode.ready(other)
    eng.decode_step([other], [3])                       # the batch goes on without it
    held.go.set()
    slow.offload.build.result(timeout=60)
    assert slow.decode.ready(slow)
    eng.decode_step([slow, other], [4, 5])
    eng.release(slow)
    eng.release(other)
    assert held.inner.held()[0] == 0


def test_a_sequence_steps_while_its_indexes_build_scanning_the_layers_not_indexed(tiny_dir):
    """``decode_while_building`` (the default): once its K/V are on the host the sequence steps, every layer scanned
    whole (``IndexSet.hold``) while its builds wait; retrieving every key, its logits are dense decoding's before the
    builds and after them, when the built indexes take over (no head is scanned then)."""
    chunks, suffix = random_request(58, lengths=(40, 30), suffix_len=3)
    dense = Engine.load(tiny_dir)
    logits, seq = dense.prefill_sequence(chunks, suffix, decode=DENSE, extra_tokens=6)
    want = torch.stack([logits] + [dense.decode_step([seq], [t])[0] for t in (4, 7, 1, 9, 2, 6)])
    dense.release(seq)
    eng = Engine.load(tiny_dir)
    eng.forward.indexes = held = _HeldIndexSet()
    logits, seq = eng.prefill_sequence(chunks, suffix, decode=RetrievalDecode(retrieval_k=4096, **SMALL),
                                       extra_tokens=6)
    for _ in range(600):                            # bounded: ready once copied and held
        if seq.decode.ready(seq):
            break
        seq.offload.copied.wait(0.1)
    assert seq.decode.ready(seq) and not seq.offload.build.done()
    offloaded = sum(seq.offload.offloaded) * eng.forward.cfg.num_kv_heads     # keys a step would read, all heads
    got = [logits]
    for t in (4, 7, 1):
        before = seq.decode_stats.keys_scanned
        got.append(eng.decode_step([seq], [t])[0])
        assert seq.decode_stats.keys_scanned - before == offloaded       # every key of every layer and head
    assert all(h.index.num_edges == 0 for heads in held.inner._heads.values() for h in heads)
    held.go.set()
    seq.offload.build.result(timeout=60)
    assert all(h.index.num_edges > 0 for heads in held.inner._heads.values() for h in heads)
    assert not held.inner._scans                     # the built indexes are searched, none scanned whole
    got += [eng.decode_step([seq], [t])[0] for t in (9, 2, 6)]
    eng.release(seq)
    torch.testing.assert_close(torch.stack(got), want, rtol=1e-5, atol=1e-5)
    assert held.inner.held()[0] == 0


def test_a_failed_build_leaves_a_held_sequence_stepping_by_scans(tiny_dir, caplog):
    """With its K/V held, a build that fails leaves the layers it did not index scanned: the sequence still decodes
    as dense does (logged), and its release drops everything."""
    chunks, suffix = random_request(59, lengths=(50,), suffix_len=3)
    want = Engine.load(tiny_dir).generate(chunks, suffix, max_new_tokens=5, stop_token_ids=[], mode="full")
    eng = Engine.load(tiny_dir)

    class Broken(_HeldIndexSet):
        def add(self, owner, layer, *args, **kwargs):
            if layer == 2:
                raise RuntimeError("index build failed")
            return self.inner.add(owner, layer, *args, **kwargs)

    eng.forward.indexes = Broken()
    with caplog.at_level("WARNING"):
        got = eng.generate(chunks, suffix, max_new_tokens=5, stop_token_ids=[], mode="full", decode="retrieval",
                           retrieval_k=4096, **SMALL)
    assert got == want
    assert "index build" in caplog.text and "scanned" in caplog.text
    assert eng.forward.indexes.held() == (0, 0, 0)


def test_releasing_a_sequence_while_its_indexes_build_drops_them_when_the_build_ends(tiny_dir):
    eng = Engine.load(tiny_dir)
    eng.forward.indexes = held = _HeldIndexSet()
    chunks, suffix = random_request(55, lengths=(50,), suffix_len=3)
    _, seq = eng.prefill_sequence(chunks, suffix, decode=RetrievalDecode(**SMALL))
    eng.release(seq)                                    # before any layer was added
    held.go.set()
    seq.offload.build.result(timeout=60)
    assert held.inner.held() == (0, 0, 0)


def test_a_failed_build_fails_its_sequence_alone(tiny_dir):
    eng = Engine.load(tiny_dir, options=EngineOptions(decode_while_building=False))

    class Broken(_HeldIndexSet):
        def add(self, *args):
            raise RuntimeError("index build failed")

    eng.forward.indexes = Broken()
    chunks, suffix = random_request(56, lengths=(50,), suffix_len=3)
    _, seq = eng.prefill_sequence(chunks, suffix, decode=RetrievalDecode(**SMALL))
    from concurrent.futures import wait

    assert wait([seq.offload.build], timeout=60).done
    with pytest.raises(RuntimeError, match="index build failed"):     # where the batcher asks, for this sequence
        seq.decode.ready(seq)
    eng.release(seq)
    assert eng.forward.indexes.held() == (0, 0, 0)


def test_retrieving_nothing_attends_the_static_set_alone(tiny_dir):
    """retrieval_k=0 (StreamingLLM's baseline): no index is built and no query tapped; the logits are attention over
    the static pages alone, which a dense engine over the same pages gives too."""
    eng = Engine.load(tiny_dir)
    chunks, suffix = random_request(57, lengths=(60, 40), suffix_len=4)
    policy = RetrievalDecode(retrieval_k=0, **SMALL)
    assert not policy.taps_queries
    stats = {}
    out = eng.generate(chunks, suffix, max_new_tokens=6, stop_token_ids=[], mode="full", decode="retrieval",
                       retrieval_k=0, stats=stats, **SMALL)
    assert len(out) == 6 and stats["keys_scanned"] == 0 and stats["pages_read"] < stats["pages_visible"]
    assert eng.forward.indexes is None
    # two sequences cut to their static set; one steps by the policy, the other densely over the same tables
    _, a = eng.prefill_sequence(chunks, suffix, mode="full", decode=policy, extra_tokens=2)
    _, b = eng.prefill_sequence(chunks, suffix, mode="full", decode=policy, extra_tokens=2)
    _, full = eng.prefill_sequence(chunks, suffix, mode="full", extra_tokens=2)
    b.decode = DENSE
    got, want, dense = (eng.decode_step([s], [9])[0] for s in (a, b, full))
    for s in (a, b, full):
        eng.release(s)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, dense, rtol=1e-3, atol=1e-3)     # what was left out mattered


def test_layer_graphs_step_as_the_eager_step_does(tiny_dir):
    """With static tails on, a retrieval batch's work between its attentions runs as a graph a layer
    (graphs/layers.py; on the CPU the same bodies run eagerly on their fixed, padded buffers): logits and stats as the
    eager step's, batch after batch (3 sequences in a bucket of 4); a dense row in the batch takes the eager step; a
    token outside the vocabulary is refused with nothing written."""
    reqs = [random_request(90 + i, lengths=(34 + 5 * i, 28), suffix_len=4) for i in range(3)]
    policy = RetrievalDecode(retrieval_k=6, **SMALL)
    out, stats, engines = [], [], []
    for static in (False, True):
        eng = Engine.load(tiny_dir, static_tails=static)
        seqs = [eng.prefill_sequence(c, s, decode=policy, extra_tokens=6)[1] for c, s in reqs]
        out.append(torch.stack([eng.decode_step(seqs, [t, t + 1, t + 2]) for t in (3, 8, 5, 1)]))
        stats.append([{k: v for k, v in s.decode_stats.as_dict().items() if k != "retrieval_seconds"} for s in seqs])
        engines.append((eng, seqs))
    eager, graphs = engines
    assert eager[0].forward.layer_graphs is None and graphs[0].forward.layer_graphs.steps == 4
    assert list(graphs[0].forward.layer_graphs.sets) == [4]
    torch.testing.assert_close(out[1], out[0], rtol=1e-5, atol=1e-5)
    assert stats[1] == stats[0] and all(s["keys_scanned"] > 0 for s in stats[0])
    eng, seqs = graphs
    before = [(s.gen_count, s.next_pos) for s in seqs]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.forward.layer_graphs.run([1, eng.cfg.vocab_size], [0, 0], [0, 0], [0, 0], None)
    assert [(s.gen_count, s.next_pos) for s in seqs] == before and graphs[0].forward.layer_graphs.steps == 4
    dense_chunks, dense_suffix = random_request(99, lengths=(30,), suffix_len=3)
    _, dense = eng.prefill_sequence(dense_chunks, dense_suffix, decode=DENSE, extra_tokens=2)
    eng.decode_step(seqs + [dense], [2, 2, 2, 2])          # two policies: the eager step
    assert eng.forward.layer_graphs.steps == 4
    for e, ss in engines:
        for s in ss + ([dense] if e is eng else []):
            e.release(s)


def test_a_step_failing_between_layer_graphs_leaves_them_serving(tiny_dir):
    """The index failing at one layer of a step fails that step (its error raised as it is); the next sequences'
    steps through the same layer graphs give what the eager step gives."""
    reqs = [random_request(110 + i, lengths=(38, 30), suffix_len=4) for i in range(2)]
    policy = RetrievalDecode(retrieval_k=5, **SMALL)
    eager = Engine.load(tiny_dir)
    want = []
    for c, s in reqs[1:]:
        _, seq = eager.prefill_sequence(c, s, decode=policy, extra_tokens=3)
        want.append(torch.stack([eager.decode_step([seq], [t])[0] for t in (4, 6)]))
        eager.release(seq)
    eng = Engine.load(tiny_dir, static_tails=True)
    _, broken = eng.prefill_sequence(*reqs[0], decode=policy, extra_tokens=3)
    index_set = eng.forward.indexes
    real = index_set.attend

    def failing(layer, *args, **kwargs):
        if layer == 1:
            raise RuntimeError("index service lost")
        return real(layer, *args, **kwargs)

    index_set.attend = failing
    with pytest.raises(RuntimeError, match="index service lost"):
        eng.decode_step([broken], [4])
    index_set.attend = real
    eng.release(broken)
    got = []
    for c, s in reqs[1:]:
        _, seq = eng.prefill_sequence(c, s, decode=policy, extra_tokens=3)
        got.append(torch.stack([eng.decode_step([seq], [t])[0] for t in (4, 6)]))
        eng.release(seq)
    assert eng.forward.layer_graphs.steps == 2
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)


def test_the_copy_to_the_host_runs_off_the_engine_thread_and_a_release_waits_for_it(tiny_dir, monkeypatch):
    """A retrieval sequence's start returns while its K/V are still being copied (the engine thread serves others
    meanwhile); its tables stay whole until they are copied; a release during the copy waits for the copy thread to
    let go of the blocks, then frees everything: nothing leaks, nothing stays in the index set."""
    import threading

    from services.engine.decode import retrieval

    eng = Engine.load(tiny_dir)
    gate, entered = threading.Event(), threading.Event()
    real = retrieval._copy

    def slow(*args):
        entered.set()
        assert gate.wait(60)
        return real(*args)

    monkeypatch.setattr(retrieval, "_copy", slow)
    chunks, suffix = random_request(49, lengths=(50, 40), suffix_len=4)
    free = eng.pool.num_free
    _, seq = eng.prefill_sequence(chunks, suffix, decode=RetrievalDecode(**SMALL))
    assert entered.wait(60) and not seq.offload.copied.is_set()       # started: the copy has not run
    assert not seq.decode.ready(seq) and seq.offload.cut is not None   # not ready, its tables whole
    _, other = eng.prefill_sequence(*random_request(50, lengths=(30,), suffix_len=3))
    eng.decode_step([other], [5])                                      # the engine serves another meanwhile
    eng.release(other)
    released = threading.Thread(target=eng.release, args=(seq,))
    released.start()
    released.join(0.5)
    assert released.is_alive()                       # waiting for the copy thread to be done with the blocks
    gate.set()
    released.join(60)
    assert not released.is_alive()
    seq.offload.build.exception(timeout=60)          # the builder stopped (cancelled) and dropped what it added
    assert seq.offload.owner not in eng.forward.indexes
    assert eng.pool.num_free == free - eng.cache.resident_bytes // eng.pool.block_bytes   # the chunks stay cached


def test_a_layer_is_indexed_as_soon_as_it_is_copied_beside_the_copy_of_the_next(tiny_dir, monkeypatch):
    """The builder takes each layer from the copy thread as it is copied: layer 0 is in the index set while layer 1's
    copy is held back; let go, every layer is, and the sequence decodes."""
    import threading

    from services.engine.decode import retrieval

    eng = Engine.load(tiny_dir)
    gate, held = threading.Event(), threading.Event()
    real = retrieval.HostStaging.to_host
    calls = []

    def to_host(self, t):
        calls.append(t.shape)
        if len(calls) == 3:                 # layer 1's keys (layer 0's keys and values went first)
            held.set()
            assert gate.wait(60)
        return real(self, t)

    monkeypatch.setattr(retrieval.HostStaging, "to_host", to_host)
    chunks, suffix = random_request(52, lengths=(50, 40), suffix_len=4)
    _, seq = eng.prefill_sequence(chunks, suffix, decode=RetrievalDecode(**SMALL), extra_tokens=2)
    assert held.wait(60)
    owner = seq.offload.owner
    for _ in range(600):                    # bounded: the builder adds layer 0 within a minute
        if eng.forward.indexes is not None and eng.forward.indexes.has(owner, 0):
            break
        threading.Event().wait(0.1)
    assert eng.forward.indexes.has(owner, 0) and not eng.forward.indexes.has(owner, 1)
    assert not seq.offload.copied.is_set()
    gate.set()
    seq.offload.build.result(timeout=60)
    assert all(eng.forward.indexes.has(owner, layer) for layer in range(eng.forward.cfg.num_layers))
    assert seq.decode.ready(seq)
    eng.decode_step([seq], [3])
    eng.release(seq)
    assert owner not in eng.forward.indexes


def test_a_staged_copy_in_pieces_on_threads_is_the_array():
    """HostStaging's host copy: pieces on several threads, a last piece short, one piece, one thread; the CPU path
    (no staging) gives the permuted tensor contiguous."""
    import numpy as np

    from services.engine.decode.retrieval import HostStaging, copy_pieces

    src = np.random.default_rng(3).standard_normal(1003).astype(np.float32)
    for threads, piece in ((4, 100), (3, 1003), (1, 7), (8, 2000)):
        dst = np.full_like(src, np.nan)
        copy_pieces(dst, src, threads, piece)
        assert np.array_equal(dst, src), (threads, piece)
    t = torch.randn(5, 3, 4)
    got = HostStaging().to_host(t.permute(1, 0, 2))
    assert got.flags.c_contiguous and np.array_equal(got, t.permute(1, 0, 2).numpy())


@pytest.mark.parametrize("populate", [True, False])
@pytest.mark.parametrize("shape, dtype", [((3, 1001, 7), np.float32), ((0, 4), np.float32), ((5,), np.int16),
                                          ((2, 3), np.float64)], ids=["f32", "empty", "i16", "f64"])
def test_a_host_array_is_zeroed_writable_and_contiguous_and_lets_its_memory_go(shape, dtype, populate):
    """``host_array``: what ``np.zeros`` gives (its pages mapped beforehand, or not); a view keeps a mapping alive,
    and the mapping goes with the last of them."""
    import gc
    import mmap
    import weakref

    from services.engine.decode.retrieval import host_array

    a = host_array(shape, dtype, populate)
    assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable
    assert not a.any()
    a[...] = 3
    root = a
    while (isinstance(root, np.ndarray) and root.base is not None) or isinstance(root, memoryview):
        root = root.base if isinstance(root, np.ndarray) else root.obj
    mapped = isinstance(root, mmap.mmap)
    assert mapped is (populate and a.size > 0)
    gone = weakref.ref(root)
    view = a.reshape(-1)[1:]
    del a, root
    gc.collect()
    assert (view == 3).all() and (gone() is not None or not mapped)      # the view keeps the mapping
    del view
    gc.collect()
    assert gone() is None                                                # gone with the last view


def test_a_copy_that_fails_fails_its_sequence_and_frees_everything(tiny_dir, monkeypatch):
    """The copy thread's error (say the host is out of memory) is the sequence's: its readiness check raises it, as
    the batcher's does, and its release frees every block; the engine goes on serving retrieval sequences."""
    from services.engine.decode.retrieval import HostStaging

    eng = Engine.load(tiny_dir)

    def broken(self, t):
        raise MemoryError("no host memory for the offloaded keys")

    monkeypatch.setattr(HostStaging, "to_host", broken)
    chunks, suffix = random_request(51, lengths=(50, 40), suffix_len=4)
    free = eng.pool.num_free
    _, seq = eng.prefill_sequence(chunks, suffix, decode=RetrievalDecode(**SMALL))
    assert seq.offload.copied.wait(60)
    with pytest.raises(MemoryError, match="host memory"):
        for _ in range(600):                       # bounded: the build fails as soon as the copy has
            if seq.decode.ready(seq):
                break
            seq.offload.build.exception(timeout=0.1)
    assert seq.offload.cut is None            # the copy thread let go of the blocks: the tables were cut all the same
    eng.release(seq)
    assert seq.offload.owner not in eng.forward.indexes
    assert eng.pool.num_free == free - eng.cache.resident_bytes // eng.pool.block_bytes
    monkeypatch.undo()
    got = eng.generate(chunks, suffix, max_new_tokens=3, stop_token_ids=[], decode="retrieval", **SMALL)
    assert len(got) == 3
