"""Decode policies: how a live sequence's decode step attends to its KV, chosen per sequence.

The seam sparse and retrieval decode plug into. A policy (``DecodePolicy``, policy.py) is given, at every layer of a
step, the query rows of the sequences that use it and their batched block table, and returns their attention
output; the step (``Forward.decode_step``) groups the batch by policy, so sequences of different policies share one
continuous batch. ``dense`` (dense.py) attends to every visible key through the engine's attention backend and is
the only policy today; a step made only of policies that replay as a CUDA graph (dense) replays as one.
"""

from __future__ import annotations

from services.engine.decode.dense import DenseDecode
from services.engine.decode.policy import DecodePolicy

POLICIES: dict[str, DecodePolicy] = {"dense": DenseDecode()}


def policy_for(name: str) -> DecodePolicy:
    """The policy of that name; ValueError naming the field and the known ones otherwise."""
    policy = POLICIES.get(name) if isinstance(name, str) else None
    if policy is None:
        raise ValueError(f"decode must be one of {sorted(POLICIES)}, got {name!r}")
    return policy


__all__ = ["POLICIES", "DecodePolicy", "DenseDecode", "policy_for"]
