"""Model runtime shared by the workers: Llama-family model, paged KV, chunk cache, blend, decode.

Names are imported on first use so that ``tessera --help`` does not pay for torch.
"""

from __future__ import annotations

_EXPORTS = {
    "Engine": "services.engine.engine",
    "EngineOptions": "services.engine.options",
    "CheckedRequest": "services.engine.kv.request_ids",
    "ModelConfig": "services.engine.model.config",
    "BlockTable": "services.engine.kv.block_table",
    "PrefillResult": "services.engine.request",
    "PrefillStats": "services.engine.request",
    "Sequence": "services.engine.request",
    "chunk_id": "services.engine.kv.chunk_cache",
    "Handoff": "services.handoff.wire",
    "ChunkRef": "services.handoff.wire",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'services.engine' has no attribute {name!r}")
