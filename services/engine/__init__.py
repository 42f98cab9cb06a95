"""Model runtime shared by the workers: Llama-family model, paged KV, chunk cache, blend, decode."""

from services.engine.block_table import BlockTable
from services.engine.chunk_cache import chunk_id
from services.engine.config import ModelConfig
from services.engine.engine import Engine
from services.engine.request import PrefillResult, PrefillStats, Sequence

__all__ = ["Engine", "ModelConfig", "BlockTable", "PrefillResult", "PrefillStats", "Sequence", "chunk_id"]
