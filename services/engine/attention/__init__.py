"""Attention: the interface (base.py) and its two backends, each owning its eager, static and decode forms."""

from __future__ import annotations

from services.engine.attention.base import PAD_POS, Attention, StaticTable, cu_one, self_causal, visible_keys
from services.engine.attention.torch_backend import TorchAttention
from services.engine.attention.triton_backend import TritonAttention

BACKENDS: dict[str, type[Attention]] = {"torch": TorchAttention, "triton": TritonAttention}

__all__ = ["Attention", "BACKENDS", "PAD_POS", "StaticTable", "TorchAttention", "TritonAttention", "cu_one",
           "self_causal", "visible_keys"]
