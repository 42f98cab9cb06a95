"""Token sampling: greedy at temperature 0, else temperature / top-k / top-p with a seeded generator.

NOTE: any finite temperature > 0 is safe, however small: the logits are shifted by their maximum before
they are divided, so every scaled score is <= 0 and none overflows to +inf (a tiny temperature is then
greedy, with ties sampled among the maxima). Logits that hold a NaN or +inf are the model's fault, not
the request's: ``sample`` raises ``NonFiniteLogits`` for them instead of drawing from a broken distribution.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.checks import check_bool, check_float, check_instance, check_int

if TYPE_CHECKING:
    import torch
# NOTE: torch is imported where it is used: the gateway reads SamplingParams' rules (services/cluster/sampling.py)
# and must not load torch for them


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How a request's tokens are drawn and when it ends: the one sampling type from the gateway (which reads it
    from the client's message) to the prefill and decode workers (which read it from the gateway's:
    services/cluster/sampling.py). ``stop_token_ids``: tokens that end the request; a worker adds the model's
    end-of-sequence tokens unless ``ignore_eos`` (``with_eos``)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_new_tokens: int = 32
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        check_float("temperature", self.temperature, 0)
        check_float("top_p", self.top_p, 0, 1, lo_open=True)
        check_int("top_k", self.top_k, 0)
        # what torch.Generator.manual_seed takes
        check_int("seed", self.seed, -(2**63), 2**64 - 1, optional=True, rule="in [-2**63, 2**64 - 1]")
        check_int("max_new_tokens", self.max_new_tokens, 1)
        check_instance("stop_token_ids", self.stop_token_ids, frozenset)
        for token in self.stop_token_ids:
            check_int("a stop token id", token, 0)
        check_bool("ignore_eos", self.ignore_eos)

    def with_eos(self, eos_token_id) -> SamplingParams:
        """These parameters with the model's end-of-sequence token(s) (an id, a list of ids, or None) among the stop
        tokens, unless ``ignore_eos``."""
        if self.ignore_eos or eos_token_id is None:
            return self
        eos = eos_token_id if isinstance(eos_token_id, list) else [eos_token_id]
        return dataclasses.replace(self, stop_token_ids=self.stop_token_ids | frozenset(eos))

    def finish_reason(self, token: int, produced: int) -> str | None:
        """"stop" when ``token`` stops the request, "length" when ``produced`` tokens are all it may have."""
        if token in self.stop_token_ids:
            return "stop"
        return "length" if produced >= self.max_new_tokens else None

    def generator(self, device: torch.device) -> torch.Generator | None:
        if self.temperature == 0:
            return None
        import torch

        g = torch.Generator(device=device)
        g.manual_seed(self.seed if self.seed is not None else torch.seed())
        return g


class NonFiniteLogits(RuntimeError):
    """The model produced logits holding a NaN or +inf: no distribution to sample from."""


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """One token id from fp32 logits [vocab]."""
    import torch

    if p.temperature == 0:
        return int(torch.argmax(logits))
    scores = logits.float()
    top = scores.max()                        # NaN if any score is NaN
    if not bool(torch.isfinite(top)):
        raise NonFiniteLogits(f"the model's logits are not finite (max {float(top)}): nothing to sample from")
    scores = (scores - top) / p.temperature   # <= 0 everywhere: no overflow at any temperature
    if p.top_k:
        kth = torch.topk(scores, min(p.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest prefix reaching top_p
        scores[order[drop]] = float("-inf")
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))
