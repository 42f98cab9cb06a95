"""The decode-policy seam: a request names its policy, unknown ones are refused by name, and sequences of different
policies share one decode step (each attends through its own policy, the rows put back in order)."""

from __future__ import annotations

import pytest
import torch

from services.engine import Engine
from services.engine.decode import POLICIES, DecodePolicy, PolicyStep, policy_for

from ..conftest import random_request


class CountingDense(DecodePolicy):
    """Dense attention through the same backend, counting the rows it was given: a stand-in for a second policy."""

    name = "counting"

    def __init__(self):
        self.rows = []

    def begin(self, fwd, seqs):
        policy = self

        class Counting(PolicyStep):
            def attend(self, layer, q, table, cu_entries):
                policy.rows.append(q.shape[0])
                return super().attend(layer, q, table, cu_entries)

        return Counting(self, fwd, seqs)


def test_dense_is_the_default_and_unknown_policies_are_refused(engine):
    from services.modes import DECODE_POLICIES

    assert tuple(POLICIES) == DECODE_POLICIES == ("dense", "quest", "retro", "retrieval")
    assert policy_for("dense").replays_graph
    chunks, suffix = random_request(5)
    with pytest.raises(ValueError, match=r"decode must be one of \['dense', 'quest', 'retrieval', 'retro'\], got 'sparse'"):
        engine.generate(chunks, suffix, max_new_tokens=2, decode="sparse")
    with pytest.raises(ValueError, match="decode must be one of"):
        policy_for(None)
    assert engine.cache.resident_bytes == 0  # refused before any pass: nothing computed or cached
    _, h = engine.prefill_handoff(chunks, suffix)
    with pytest.raises(ValueError, match="decode must be one of"):
        engine.import_handoff(h, decode="sparse")


def test_sequences_of_two_policies_share_a_step(tiny_dir):
    """Three sequences decoded together, the middle one through another policy: every sequence gets the logits it
    gets alone, and the other policy saw only its own row at every layer."""
    eng = Engine.load(tiny_dir)
    requests = [random_request(seed, lengths=(9 + seed, 14), suffix_len=3) for seed in (61, 62, 63)]
    alone = []
    for chunks, suffix in requests:
        _, h = eng.prefill_handoff(chunks, suffix)
        seq = eng.import_handoff(h)
        alone.append(eng.decode_step([seq], [7])[0])
        eng.release(seq)
    other = CountingDense()
    seqs = []
    for i, (chunks, suffix) in enumerate(requests):
        _, h = eng.prefill_handoff(chunks, suffix)
        seqs.append(eng.import_handoff(h))
        if i == 1:
            eng.start_decode(seqs[-1], other)
    together = eng.decode_step(seqs, [7, 7, 7])
    for want, got in zip(alone, together):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert other.rows == [1] * eng.cfg.num_layers
    for seq in seqs:
        eng.release(seq)
