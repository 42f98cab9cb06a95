"""One sampling type from the gateway to the workers: SamplingParams written to the gateway's message and read back
by a worker is the same object, with the model's end-of-sequence tokens added unless ignore_eos."""

from __future__ import annotations

import pytest

from services.cluster.sampling import DEFAULT_MAX_NEW_TOKENS, read_sampling, write_sampling
from services.engine.sampling import SamplingParams
from services.rpc import tessera_pb2 as pb


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(0.75, 0.875, 40, 2**64 - 1, 5, frozenset({3, 9})),
                                    SamplingParams(seed=0, ignore_eos=True, stop_token_ids=frozenset({0}))])
def test_written_and_read_back_is_the_same_params(params):
    """(The message holds temperature and top_p as float32: values it represents exactly come back exactly.)"""
    assert read_sampling(write_sampling(params)) == params


def test_a_worker_adds_the_models_end_of_sequence_tokens_unless_told_not_to():
    wire = write_sampling(SamplingParams(stop_token_ids=frozenset({5})))
    assert read_sampling(wire, 2).stop_token_ids == {2, 5}
    assert read_sampling(wire, [2, 7]).stop_token_ids == {2, 5, 7}
    wire.ignore_eos = True
    assert read_sampling(wire, [2, 7]).stop_token_ids == {5}


def test_unset_fields_read_as_the_defaults_and_bad_values_name_the_field():
    got = read_sampling(pb.SamplingParams())
    assert (got.top_p, got.max_new_tokens, got.seed) == (1.0, DEFAULT_MAX_NEW_TOKENS, None)
    with pytest.raises(ValueError, match="top_k"):
        read_sampling(pb.SamplingParams(top_k=-1))
    with pytest.raises(ValueError, match="temperature"):
        read_sampling(pb.SamplingParams(temperature=float("nan")))
    with pytest.raises(ValueError, match="stop token id"):
        SamplingParams(stop_token_ids=frozenset({-1}))


def test_finish_reason():
    p = SamplingParams(max_new_tokens=3, stop_token_ids=frozenset({9}))
    assert [p.finish_reason(9, 1), p.finish_reason(4, 2), p.finish_reason(4, 3)] == ["stop", None, "length"]
