"""The attention-aware vector index (issue #22): one graph index per (layer, KV head) over the keys a
decode step retrieves from, searched by inner product (``graph.AttentionIndex``, built by ``build.py``).

Only the index is exported, imported on first use (numba and faiss load then): the engine imports this
package, so nothing here may import grpc or ray.
"""

from __future__ import annotations

_EXPORTS = {
    "AttentionIndex": "services.index.graph",
    "IndexFormatError": "services.index.format",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'services.index' has no attribute {name!r}")
