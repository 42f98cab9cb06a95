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

# the decode policies a request may name (services/engine/decode holds them; the gateway and the SDK check names here).
# The engine's "retrieval" is not among them yet: its index is built from the prefill pass's queries, which a
# hand-off does not carry (services/engine/decode/retrieval.py)
DECODE_POLICIES: tuple[str, ...] = ("dense", "quest", "retro")
# each policy's parameters (a request giving another policy's is refused), and retro's largest window (the engine's
# RetroDecode takes the same: a test keeps them equal)
DECODE_PARAMS: dict[str, tuple[str, ...]] = {"dense": (), "quest": ("budget_tokens", "dense_layers"),
                                             "retro": ("budget_tokens", "dense_layers", "retro_window")}
MAX_RETRO_WINDOW = 16
