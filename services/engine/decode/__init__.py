"""Decode policies: how a live sequence's decode step attends to its KV, chosen per sequence.

The seam sparse and retrieval decode plug into. A policy (``DecodePolicy``, policy.py) is given, at every layer of a
step, the query rows of the sequences that use it and their batched block table, and returns their attention
output; the step (``Forward.decode_step``) groups the batch by policy, so sequences of different policies share one
continuous batch. ``dense`` (dense.py) attends to every visible key through the engine's attention backend;
``quest`` (quest.py) to the pages its key bounds select within a budget; ``retro`` (retro.py) as quest, and the pages
a step reads also correct its last tokens' attention, which re-embed into the layers above; ``retrieval``
(retrieval.py) to a static set of pages on the GPU and the keys a CPU index retrieves for it. A step made only of
policies that replay as a CUDA graph (dense) replays as one.
"""

from __future__ import annotations

from services.engine.decode.dense import DenseDecode
from services.engine.decode.policy import DecodePolicy, PastRows, PolicyStep
from services.engine.decode.quest import QuestDecode
from services.engine.decode.retrieval import HANDOFF_QUERIES, Offload, QueryTap, RetrievalDecode
from services.engine.decode.retro import PastToken, RetroDecode, RetroRecords, clear_window
from services.engine.decode.stats import DecodeStats

# the names services/modes.py's DECODE_POLICIES gives the gateway and the SDK (a test keeps the two equal)
POLICIES: dict[str, type[DecodePolicy]] = {"dense": DenseDecode, "quest": QuestDecode, "retro": RetroDecode,
                                           "retrieval": RetrievalDecode}
DENSE = DenseDecode()


def policy_for(name: str, **params) -> DecodePolicy:
    """The policy of that name with its parameters (quest: budget_tokens, dense_layers; retro: those and
    retro_window; retrieval: retrieval_k, sink_tokens, window_tokens); ValueError naming the
    field for an unknown name or a bad value, TypeError for a parameter the policy does not take."""
    cls = POLICIES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"decode must be one of {sorted(POLICIES)}, got {name!r}")
    if cls is DenseDecode:
        if params:
            raise TypeError(f"decode='dense' takes no parameters, got {sorted(params)}")
        return DENSE
    return cls(**params)


__all__ = ["DENSE", "HANDOFF_QUERIES", "POLICIES", "DecodePolicy", "DecodeStats", "DenseDecode", "Offload", "PastRows", "PastToken",
           "PolicyStep", "QueryTap", "QuestDecode", "RetrievalDecode", "RetroDecode", "RetroRecords", "clear_window",
           "policy_for"]
