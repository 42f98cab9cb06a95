"""The decode-policy interface (services/engine/decode/__init__.py says where it plugs in)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
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
    layer_graphs: bool = False   # a step's work between its attentions may replay as graphs (graphs/layers.py)
    taps_queries: bool = False   # whether ``prepare`` reads the prefill pass's queries (Sequence.prefill_queries)

    def check(self, block_size: int, num_layers: int) -> None:
        """ValueError naming the field for a parameter this engine cannot serve (nothing, unless a policy says)."""

    def prepare(self, fwd: Forward, seq: Sequence) -> None:
        """Once, when ``seq`` starts decoding under this policy (after its prefill or import)."""

    def ready(self, seq: Sequence) -> bool:
        """Whether ``seq`` can step now (a policy that prepares in the background says when it is done; an error of
        that preparation is raised here, for the sequence alone to fail)."""
        return True

    def release(self, fwd: Forward, seq: Sequence) -> None:
        """When ``seq`` is released: what ``prepare`` made for it elsewhere is dropped."""

    def begin(self, fwd: Forward, seqs: list[Sequence]) -> PolicyStep:
        """One decode step of ``seqs`` (this policy's rows of the batch). The step's sequences have their new
        token's slot counted already (``gen_count``)."""
        return PolicyStep(self, fwd, seqs)


@dataclass(slots=True)
class PastRows:
    """Rows that join a step's batch after a layer's attention and run its later layers with it (RetroAttention's
    re-embedded past tokens): residual input h [R, hidden] of the layer they join at, their attention output there
    attn [R, Hq, D], and where their K/V live: positions, blocks and slots [R] (int64)."""

    h: torch.Tensor
    attn: torch.Tensor
    pos: torch.Tensor
    block: torch.Tensor
    slot: torch.Tensor


class PolicyStep:
    """A policy's part of one decode step: its rows' attention at every layer, and (Retro) past rows."""

    def __init__(self, policy: DecodePolicy, fwd: Forward, seqs: list[Sequence]):
        self.policy, self.fwd, self.seqs = policy, fwd, seqs

    def attend(self, layer: int, q: torch.Tensor, table: BlockTable, cu_entries: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, D] of this step's rows, sequence b's entries in table[cu[b]:cu[b+1]] (its layer table, then
        its generated tokens) -> out [B, Hq, D]."""
        return self.fwd.attention.decode(layer, q, table, cu_entries)

    def join(self, layer: int, h: torch.Tensor) -> PastRows | None:
        """Past rows joining after ``layer``'s attention (called right after ``attend`` at that layer, ``h``: this
        step's rows' residual input to it), or None."""
        return None

    def attend_past(self, layer: int, table: BlockTable, cu_entries: torch.Tensor) -> torch.Tensor:
        """The joined past rows' attention output at a later layer (after ``attend`` at it) [R, Hq, D]."""
        raise NotImplementedError

    def end(self) -> None:
        """After the step's last layer: what each sequence read (a dense step: every page it sees)."""
        count_dense(self.fwd, self.seqs)

    def stale(self) -> bool:
        """Whether a graph captured with this step reads buffers that have moved since (its ``load`` just moved
        them): graphs/decode.py captures it again."""
        return False

    def captured(self) -> None:
        """A graph has just captured this step (with the buffers it holds now)."""


def count_dense(fwd: Forward, seqs: list[Sequence]) -> None:
    """A dense step's reads in each sequence's stats."""
    layers, heads = fwd.cfg.num_layers, fwd.cfg.num_kv_heads
    for s in seqs:
        pages = s.decode_stats.visible(s, layers, heads)
        s.decode_stats.add(pages, pages)
