"""Sampling on the wire: the one sampling type (``SamplingParams``, services/engine/sampling.py, torch-free) to and
from the gateway's message to the workers, with the defaults in one place. The prefill worker samples the first
token, the decode worker the rest; both read the same message the same way.

A seeded request's first token is drawn the same way on both sides: the decode worker draws it again
from the hand-off's logits with its own generator, which leaves that generator exactly where the
prefill worker's was, and then keeps the prefill worker's token (the one the client already has).
"""

from __future__ import annotations

from services.engine.sampling import SamplingParams
from services.modes import DECODE_FIELDS
from services.rpc import tessera_pb2 as pb

DEFAULT_MAX_NEW_TOKENS = 16


def read_sampling(s: pb.SamplingParams, eos_token_id=None, default_max: int = DEFAULT_MAX_NEW_TOKENS) -> SamplingParams:
    """The message's parameters (top_p 0 and max_new_tokens 0 read as unset), with the model's end-of-sequence
    token(s) among the stops unless ignore_eos; ValueError naming the field for a value out of range."""
    params = SamplingParams(float(s.temperature), float(s.top_p) if s.top_p else 1.0, s.top_k,
                            s.seed if s.HasField("seed") else None, s.max_new_tokens or default_max,
                            frozenset(s.stop_token_ids), s.ignore_eos)
    return params.with_eos(eos_token_id)


def write_sampling(params: SamplingParams) -> pb.SamplingParams:
    """The message a worker reads back as ``params`` (``read_sampling``)."""
    p = pb.SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                          max_new_tokens=params.max_new_tokens, stop_token_ids=sorted(params.stop_token_ids),
                          ignore_eos=params.ignore_eos)
    if params.seed is not None:
        p.seed = params.seed
    return p


def read_decode_policy(p: pb.DecodePolicy) -> tuple[str, dict]:
    """A request's decode policy on the wire: its name ("dense" when empty) and the parameters it sets, as
    ``Engine.decode_policy(name, **params)`` takes them (each worker checks them against its engine)."""
    return p.name or "dense", {f: getattr(p, f) for f in DECODE_FIELDS if p.HasField(f)}
