"""The decode-policy interface (services/engine/decode/__init__.py says where it plugs in)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from services.engine.kv.block_table import BlockTable
    from services.engine.passes.forward import Forward
    from services.engine.request import Sequence


class DecodePolicy:
    """How the sequences that use it attend at a decode step.

    name: what a request names it by (``Engine.generate(decode=...)``).
    replays_graph: whether a step made only of sequences of this policy may replay as a CUDA graph
    (graphs/decode.py captures dense attention through the engine's backend; a policy that selects keys per step
    says False until it has a capturable form)."""

    name: str = "base"
    replays_graph: bool = False

    def check(self, block_size: int, num_layers: int) -> None:
        """ValueError naming the field for a parameter this engine cannot serve (nothing, unless a policy says)."""

    def attend(self, fwd: Forward, layer: int, q: torch.Tensor, seqs: list[Sequence], table: BlockTable,
               cu_entries: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, D] of ``seqs`` (this policy's rows of the step), sequence b's entries in
        table[cu[b]:cu[b+1]] (its layer table, then its generated tokens) -> out [B, Hq, D]."""
        raise NotImplementedError
