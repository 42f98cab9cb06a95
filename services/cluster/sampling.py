"""Sampling as the workers read it from the wire: one place for the defaults, the stop set and when a
request is over, shared by the prefill worker (which samples the first token) and the decode worker
(which samples the rest).

A seeded request's first token is drawn the same way on both sides: the decode worker draws it again
from the hand-off's logits with its own generator, which leaves that generator exactly where the
prefill worker's was, and then keeps the prefill worker's token (the one the client already has).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.sampling import SamplingParams
from services.rpc import tessera_pb2 as pb

DEFAULT_MAX_NEW_TOKENS = 16


@dataclass(frozen=True, slots=True)
class WireSampling:
    params: SamplingParams
    stops: frozenset[int]

    @classmethod
    def read(cls, s: pb.SamplingParams, eos_token_id) -> WireSampling:
        """ValueError (from SamplingParams) for values out of range."""
        stops = set(s.stop_token_ids)
        if not s.ignore_eos and eos_token_id is not None:
            stops |= set(eos_token_id if isinstance(eos_token_id, list) else [eos_token_id])
        params = SamplingParams(s.temperature, s.top_p or 1.0, s.top_k, s.seed if s.HasField("seed") else None,
                                s.max_new_tokens or DEFAULT_MAX_NEW_TOKENS)
        return cls(params, frozenset(stops))

    def finish_reason(self, token: int, produced: int) -> str | None:
        """"stop" when ``token`` stops the request, "length" when ``produced`` tokens are all it may have."""
        if token in self.stops:
            return "stop"
        return "length" if produced >= self.params.max_new_tokens else None
