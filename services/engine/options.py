"""The engine's options: one frozen object given at construction, never a module switch.

Every field is a default that won its A/B, kept switchable only where a benchmark or a test needs its peer (the
general paths the graphs replace, cuBLAS against the skinny GEMM, plain launches against PDL). Options are read
when the engine is built and when a graph is captured; they are frozen, so nothing flipped after the warm-up can
leave a captured graph disagreeing with the engine that replays it, and every captured graph records the kernel
options it was captured with (``graphs.capture``). Environment variables are read in one place, at worker
start (``services/env.py``), into one of these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kernels.options import KernelOptions
from services.checks import check_bool, check_instance, check_int, check_str
from services.env import flag


LAYERED_PREFILL = ("auto", "always", "never")


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """skinny_gemm: projections of few rows (short passes, decode steps) on the weight-streaming Triton GEMM
    (kernels/linear) when the kernel backend is Triton; off, every projection on cuBLAS. 2-10% faster per
    projection on an H100 (bench/skinny_gemm/README.md), but a first decode step compiles it: 4.11 s against
    1.37 s on an empty Triton cache.
    reuse_graph: a ratio-0 reuse pass that fits a static tail runs as one pinned copy and one replay
    (reuse_tail.py); off, through the general static tail.
    blend_graph: a ratio > 0 pass that fits runs as one pinned copy and one graph, the check layer's selection
    included (blend_tail.py); off, layer 0 and the selection eagerly, then the general static tail.
    kernels: what the Triton launches read (kernels/options.py: PDL, TMA).
    index_threads: the host threads of the engine's own retrieval index set (services/index/heads.py), which builds
    and searches the indexes of its retrieval sequences: a layer's heads in parallel.
    index_host_dtype: how that index set holds a retrieval sequence's offloaded keys and values on the host:
    "float32", or "bfloat16" for half the bytes (the values as the pool holds them, the keys rounded once more after
    their rotation; services/index/half.py): 512K tokens of an 8B-shaped model need 137 GB in float32, 69 in bfloat16.
    chunk_indexes: a retrieval sequence reuses each shared chunk's own index graphs (built once per chunk, in its
    frame: services/index/chunks.py), kept in host memory up to ``chunk_index_bytes``; off, every sequence builds one
    index over all its offloaded keys.
    layered_prefill: when a retrieval sequence in mode ``full`` is prefilled layer by layer, one layer's K/V at a time
    outside the pool, its static set alone kept in the pool (passes/layered.py): "auto" when its context's blocks are
    more than the pool can give it now (the free blocks and the chunk cache's unpinned ones), "always", or "never"
    (such a context then fails as any request the pool cannot hold).
    decode_while_building: a retrieval sequence steps once its K/V are on the host, before its indexes are built, each
    layer not yet indexed scanned whole (``IndexSet.hold``: exact up to the int8 codes' beam, and every key read) until
    its index replaces it; off, its first step waits for every index. (The engine's own index set only: a decode
    worker's index service builds before it answers.)"""

    skinny_gemm: bool = True
    reuse_graph: bool = True
    blend_graph: bool = True
    kernels: KernelOptions = field(default_factory=KernelOptions)
    index_threads: int = 4
    index_host_dtype: str = "float32"
    chunk_indexes: bool = True
    chunk_index_bytes: int = 4 << 30
    layered_prefill: str = "auto"
    decode_while_building: bool = True

    def __post_init__(self) -> None:
        for name in ("skinny_gemm", "reuse_graph", "blend_graph"):
            check_bool(f"EngineOptions.{name}", getattr(self, name))
        check_instance("EngineOptions.kernels", self.kernels, KernelOptions)
        check_int("EngineOptions.index_threads", self.index_threads, 1)
        check_str("EngineOptions.index_host_dtype", self.index_host_dtype, choices=("float32", "bfloat16"))
        check_bool("EngineOptions.chunk_indexes", self.chunk_indexes)
        check_int("EngineOptions.chunk_index_bytes", self.chunk_index_bytes, 0)
        check_str("EngineOptions.layered_prefill", self.layered_prefill, choices=LAYERED_PREFILL)
        check_bool("EngineOptions.decode_while_building", self.decode_while_building)

    @classmethod
    def from_env(cls, environ=None) -> "EngineOptions":
        """The options a worker starts with: the defaults, but where its environment turns one off
        (``services/env.py``: TESSERA_PDL, TESSERA_TMA, TESSERA_SKINNY_GEMM, TESSERA_REUSE_GRAPH,
        TESSERA_BLEND_GRAPH)."""
        return cls(skinny_gemm=flag("TESSERA_SKINNY_GEMM", environ), reuse_graph=flag("TESSERA_REUSE_GRAPH", environ),
                   blend_graph=flag("TESSERA_BLEND_GRAPH", environ),
                   kernels=KernelOptions(pdl=flag("TESSERA_PDL", environ), tma=flag("TESSERA_TMA", environ)))
