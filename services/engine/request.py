"""Typed hand-offs of the engine: a placed chunk, a sequence's KV state, prefill results and stats."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from services.engine.decode import DENSE, DecodePolicy, DecodeStats, Offload, PastToken, QueryTap
from services.engine.kv.block_table import BlockTable
from services.engine.kv.chunk_cache import ChunkEntry
from services.modes import MODES  # noqa: F401 - named here for its importers


@dataclass(frozen=True, slots=True)
class PlacedChunk:
    """A cached chunk placed in a request: its tokens occupy global positions start..start+length-1.

    ``rot`` = start - entry.base is the RoPE offset applied to its keys inside attention
    (0 for position-aware replicas, which were computed at this very position).
    """

    entry: ChunkEntry
    start: int

    @property
    def rot(self) -> int:
        return self.start - self.entry.base


@dataclass(slots=True)
class PrefillStats:
    mode: str
    recompute_ratio: float
    check_layer: int
    chunks: int = 0
    chunk_hits: int = 0              # found in the device chunk cache
    store_hits: int = 0              # streamed from the KV store, layer by layer
    chunk_misses: int = 0            # computed here
    chunk_tokens: int = 0
    chunk_tokens_computed: int = 0   # tokens of missing chunks computed alone (or in context: prefix/full)
    tokens_recomputed: int = 0       # HKVD chunk tokens recomputed by the blend step
    suffix_tokens: int = 0
    shared_blocks_allocated: int = 0
    private_blocks_allocated: int = 0
    copied_blocks: int = 0           # blend_copy's re-rotated copies
    chunk_compute_seconds: float = 0.0
    forward_seconds: float = 0.0
    total_seconds: float = 0.0
    load_seconds: float = 0.0        # longest chunk stream from the store
    load_wait_seconds: float = 0.0   # time the pass stood waiting for a layer (the rest overlapped)
    loaded_bytes: int = 0
    load_failures: int = 0           # streams that broke and were recomputed

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(slots=True)
class Sequence:
    """KV state of one request between prefill and the end of decode.

    layer_tables[l] are the entries layer l attends to (objects are shared between layers with the same
    view); generated tokens are appended to ``gen_blocks`` and seen by every layer.
    """

    layer_tables: list[BlockTable]
    pinned: list[ChunkEntry]
    private_blocks: list[int]
    next_pos: int
    gen_blocks: list[int] = field(default_factory=list)
    gen_count: int = 0
    released: bool = False
    chunk_tokens: dict = field(default_factory=dict)  # chunk key -> token ids (carried in hand-offs)
    decode: DecodePolicy = DENSE  # how its decode steps attend (services/engine/decode)
    decode_stats: DecodeStats = field(default_factory=DecodeStats)  # what its decode steps read
    past: list[PastToken] = field(default_factory=list)  # RetroAttention's window (decode/retro.py), oldest first
    prefill_queries: QueryTap | None = None  # its prefill pass's queries, until a retrieval decode indexes them
    offload: Offload | None = None  # what a retrieval decode keeps off the GPU (decode/retrieval.py)


@dataclass(frozen=True, slots=True)
class PrefillResult:
    logits: torch.Tensor   # [vocab] fp32, next-token logits after the suffix
    stats: PrefillStats
