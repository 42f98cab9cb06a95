"""Token sampling: greedy at temperature 0, else temperature / top-k / top-p with a seeded generator.

NOTE: any finite temperature > 0 is safe, however small: the logits are shifted by their maximum before
they are divided, so every scaled score is <= 0 and none overflows to +inf (a tiny temperature is then
greedy, with ties sampled among the maxima). Logits that hold a NaN or +inf are the model's fault, not
the request's: ``sample`` raises ``NonFiniteLogits`` for them instead of drawing from a broken distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.checks import check_float, check_int

if TYPE_CHECKING:
    import torch
# NOTE: torch is imported where it is used: the gateway reads SamplingParams' rules (services/cluster/sampling.py)
# and must not load torch for them


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_new_tokens: int = 32

    def __post_init__(self) -> None:
        check_float("temperature", self.temperature, 0)
        check_float("top_p", self.top_p, 0, 1, lo_open=True)
        check_int("top_k", self.top_k, 0)
        # what torch.Generator.manual_seed takes
        check_int("seed", self.seed, -(2**63), 2**64 - 1, optional=True, rule="in [-2**63, 2**64 - 1]")
        check_int("max_new_tokens", self.max_new_tokens, 1)

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
