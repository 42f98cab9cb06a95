"""The serving modes, defined once for the engine, the gateway, the SDK's users and the load generator (no
dependency: every layer may import it).

- ``full``: no reuse, every token computed;
- ``prefix``: prefix caching (a chunk reused only behind the same chunks);
- ``position_aware``: a replica of each chunk per position (Block-Attention / PromptCache style);
- ``blend_copy``: CacheBlend as published, chunks re-rotated by copy;
- ``tessera``: deferred RoPE (one copy at any position) and selective recompute, the default.
"""

from __future__ import annotations

from enum import Enum


class Mode(str, Enum):
    FULL = "full"
    PREFIX = "prefix"
    POSITION_AWARE = "position_aware"
    BLEND_COPY = "blend_copy"
    TESSERA = "tessera"


MODES: tuple[str, ...] = tuple(m.value for m in Mode)

# how the gateway picks a prefill worker (services/gateway/router.py): the chunk residency of the request's chunks
# less a load penalty, or load alone (an A/B's peer)
ROUTINGS: tuple[str, ...] = ("residency", "load")

# the decode policies a request may name (services/engine/decode holds them; the gateway and the SDK check names here)
DECODE_POLICIES: tuple[str, ...] = ("dense", "quest", "retro", "retrieval")
# each policy's parameters (a request giving another policy's is refused), and retro's largest window (the engine's
# RetroDecode takes the same: a test keeps them equal)
DECODE_PARAMS: dict[str, tuple[str, ...]] = {"dense": (), "quest": ("budget_tokens", "dense_layers"),
                                             "retro": ("budget_tokens", "dense_layers", "retro_window"),
                                             "retrieval": ("retrieval_k", "sink_tokens", "window_tokens")}
DECODE_FIELDS: tuple[str, ...] = tuple(dict.fromkeys(f for fields in DECODE_PARAMS.values() for f in fields))
MAX_RETRIEVAL_K = 65536   # a retrieval request's largest k (the gateway's and the index service's bound)
MAX_RETRO_WINDOW = 16
