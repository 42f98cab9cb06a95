"""Dense decode: every visible key of the sequence, through the engine's attention backend."""

from __future__ import annotations

from services.engine.decode.policy import DecodePolicy


class DenseDecode(DecodePolicy):
    name = "dense"
    replays_graph = True
