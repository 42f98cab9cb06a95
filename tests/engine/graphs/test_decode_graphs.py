"""Decode steps on static buffers (the code CUDA graphs capture) equal the eager decode step.

Each test imports the same hand-offs twice into one engine (identical KV), then decodes one copy with
the eager step and the other with the static step, feeding both the same tokens. The batch mixes
chunk layouts, blend (two views across layers) and plain sequences; block size 4 makes sequences
cross block boundaries while decoding; a smaller batch in the same bucket after a larger one leaves
stale rows that must stay inert.
"""

from __future__ import annotations

import pytest
import torch

from services.engine import Engine, Handoff
from services.engine.decode import DENSE
from services.engine.graphs.decode import DecodeGraphs
from services.engine.kv.loader import numbered

from ..conftest import cpu_triton, random_request

pytestmark = pytest.mark.slow

REQUESTS = [  # (seed, chunk lengths, suffix length, mode, ratio)
    (70, (13, 21, 9), 5, "tessera", 0.3),
    (71, (11, 9), 3, "tessera", 0.0),
    (72, (17,), 4, "prefix", 0.0),
    (73, (6, 30), 2, "tessera", 0.3),
    (74, (9, 9, 9), 6, "position_aware", 0.3),
    (75, (25,), 1, "full", 0.0),
]
TOL = 1e-5  # fp32: padded rows change the matmul shapes, and with them the CPU kernels' summation order


@pytest.fixture(scope="module")
def handoffs(tiny_dir):
    """Hand-offs of REQUESTS made once (torch backend: fast on the CPU) and a fetch for their chunks, so
    an engine under test rebuilds twin sequences without computing anything."""
    src = Engine.load(tiny_dir, block_size=4)
    out = []
    for seed, lengths, suffix_len, mode, ratio in REQUESTS:
        chunks, suffix = random_request(seed, lengths=lengths, suffix_len=suffix_len)
        out.append(src.prefill_handoff(chunks, suffix, mode=mode, recompute_ratio=ratio)[1])

    def fetch(cid):
        return numbered(src.export_chunk(cid))

    return out, fetch


def _twins(eng, handoffs, n=len(REQUESTS)):
    """Two identical sets of n sequences (eager, static) on ``eng`` and their first tokens."""
    hs, fetch = handoffs
    sets = [[eng.import_handoff(h, fetch=fetch) for h in hs[:n]] for _ in range(2)]
    return sets[0], sets[1], [int(h.logits.argmax()) for h in hs[:n]]


def _step(eng, seqs, tokens, static: bool):
    eng.forward.static_tails = static
    try:
        return eng.decode_step(seqs, tokens)
    finally:
        eng.forward.static_tails = True


def _decode_both(eng, eager, static, tokens, steps):
    for _ in range(steps):
        a = _step(eng, eager, tokens, False)
        b = _step(eng, static, tokens, True)
        torch.testing.assert_close(b, a, rtol=TOL, atol=TOL)
        tokens = a.argmax(-1).tolist()
    for x, y in zip(eager, static):  # the new tokens' slots were written at their positions
        assert x.gen_count == y.gen_count and x.next_pos == y.next_pos
        n = x.gen_count
        pos = [eng.pool.slot_pos[s.gen_blocks[i // eng.block_size], i % eng.block_size].item()
               for s in (x, y) for i in range(n)]
        assert pos[:n] == pos[n:] == list(range(x.next_pos - n, x.next_pos))
    return tokens


@pytest.fixture(scope="module", params=["torch", "triton"])
def engine4(request, tiny_dir):
    if request.param == "triton":
        cpu_triton()
    return Engine.load(tiny_dir, attention_backend=request.param, static_tails=True, block_size=4)


def _release(eng, *sets):
    for seqs in sets:
        for seq in seqs:
            eng.release(seq)


def test_static_decode_equals_eager(engine4, handoffs):
    eng = engine4
    eager, static, tokens = _twins(eng, handoffs)
    assert max(len({id(t) for t in s.layer_tables}) for s in static) >= 2  # blends: layers see two views
    try:
        tokens = _decode_both(eng, eager, static, tokens, 2)  # 6 sequences: bucket 8
        graphs = eng.forward.decode_graphs
        assert list(graphs.graphs) == [(8, 256, DENSE)] and graphs.replays == 2
        # one sequence leaves: 5 in the same bucket, row 5 keeps stale inputs that must stay inert
        for seqs in (eager, static):
            eng.release(seqs.pop(2))
        tokens = _decode_both(eng, eager, static, tokens[:2] + tokens[3:], 1)
        assert list(graphs.graphs) == [(8, 256, DENSE)] and graphs.replays == 3
        # two go on in the bucket of 2 (its own graph), across a block boundary of their generated tokens
        _decode_both(eng, eager[:2], static[:2], tokens[:2], 2)
        assert (2, 256, DENSE) in graphs.graphs and graphs.replays == 5
        assert all(s.gen_count > eng.block_size for s in static[:2])
    finally:
        _release(eng, eager, static)


def test_forced_splits_are_merged(handoffs, tiny_dir):
    """Three splits per sequence (merged by LSE), padded sequences with no entries in every split."""
    cpu_triton()
    eng = Engine.load(tiny_dir, attention_backend="triton", static_tails=True, block_size=4)
    eager, static, tokens = _twins(eng, handoffs, n=3)
    graphs = eng.forward.decode_graphs = DecodeGraphs(eng.forward)
    graphs.num_splits = 3
    try:
        _decode_both(eng, eager, static, tokens, 2)
        assert [g.splits for g in graphs.graphs.values()] == [3] and graphs.replays == 2
    finally:
        _release(eng, eager, static)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_masks_past_16_bits(handoffs, tiny_dir, backend):
    """Block size 32: slot masks live in their own int64 buffer, which the kernel reads in place."""
    if backend == "triton":
        cpu_triton()
    eng = Engine.load(tiny_dir, attention_backend=backend, static_tails=True, block_size=32)
    eager, static, tokens = _twins(eng, handoffs, n=3)
    try:
        _decode_both(eng, eager, static, tokens, 2)
        assert eng.forward.decode_graphs.replays == 2
    finally:
        _release(eng, eager, static)


def test_tables_copied_to_the_host_once(tiny_dir, handoffs):
    eng = Engine.load(tiny_dir, static_tails=True, block_size=4)
    eager, static, tokens = _twins(eng, handoffs)
    # imported sequences' tables were built on the host: their rows come along, no copy back
    assert all(t.host_rows is not None for s in static for t in s.layer_tables)
    _decode_both(eng, eager, static, tokens, 3)
    host = eng.forward.decode_graphs.host
    assert host.copies == 0
    assert len(host._held) == len({id(t) for s in static for t in s.layer_tables})
    # a sequence prefilled here has device-built tables: one copy at its first step for all of them, none after
    chunks, suffix = random_request(77)
    logits, seq, _ = eng._prefill(chunks, suffix, "tessera", 0.15)
    batch, toks = static + [seq], tokens + [int(logits.argmax())]
    for _ in range(3):
        toks = eng.decode_step(batch, toks).argmax(-1).tolist()
    assert host.copies == 1
    eng.release(seq)


def test_past_the_buckets_runs_eagerly(tiny_dir, handoffs):
    eng = Engine.load(tiny_dir, static_tails=True, block_size=4)
    eager, static, tokens = _twins(eng, handoffs)
    tokens = _decode_both(eng, eager, static, tokens, 1)
    graphs = eng.forward.decode_graphs
    assert graphs.replays == 1
    graphs.buckets = (1, 2, 4)  # 6 sequences: past the largest bucket
    tokens = _decode_both(eng, eager, static, tokens, 1)
    graphs.buckets, graphs.max_entries = (1, 2, 4, 8), 64  # this batch has more entries than that
    _decode_both(eng, eager, static, tokens, 1)
    assert graphs.replays == 1


def test_bad_token_is_refused(tiny_dir):
    eng = Engine.load(tiny_dir, static_tails=True)
    chunks, suffix = random_request(76)
    _, seq, _ = eng._prefill(chunks, suffix, "tessera", 0.0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.decode_step([seq], [eng.cfg.vocab_size])
    eng.release(seq)


def test_static_decode_generates_as_eager_generate(tiny_dir, mode="tessera", ratio=0.3):
    """A hand-off decoded elsewhere through the static step yields Engine.generate's tokens."""
    prefill, decode = Engine.load(tiny_dir), Engine.load(tiny_dir, static_tails=True)
    chunks, suffix = random_request(77, lengths=(14, 22))
    ref = prefill.generate(chunks, suffix, max_new_tokens=6, mode=mode, recompute_ratio=ratio, stop_token_ids=[])
    _, h = prefill.prefill_handoff(chunks, suffix, mode=mode, recompute_ratio=ratio)
    seq = decode.import_handoff(Handoff.from_bytes(h.to_bytes()))
    toks = [int(h.logits.argmax())]
    try:
        while len(toks) < 6:
            toks.append(int(decode.decode_step([seq], [toks[-1]])[0].argmax()))
    finally:
        decode.release(seq)
    assert toks == ref
    assert decode.forward.decode_graphs.replays == 5
