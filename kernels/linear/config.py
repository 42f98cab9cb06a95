"""Launch configuration of the skinny-GEMM kernel (kernels/linear/triton.py), kept free of Triton so the
dispatcher, the bench and the tests can build and print configurations anywhere."""

from __future__ import annotations

from dataclasses import dataclass

REDUCES = ("arrive", "kernel")
TMA_MODES = ("off", "w", "xw")  # pointer loads; weight tiles by TMA; weight and x tiles by TMA


@dataclass(frozen=True, slots=True)
class LinearConfig:
    """One launch of y[M, N] = x[M, K] @ w[N, K].T.

    Tiles of block_m rows x block_n weight rows, stepping block_k along K; ``split_k`` programs share a
    tile's K range (each a contiguous slice of whole block_k steps). With split_k > 1 each program
    writes an fp32 partial [split, M, N] and the partials are summed in split order (deterministic) by
    either the last program of the tile to arrive (``reduce="arrive"``: one launch, a per-tile counter
    that the reducing program resets) or a second small kernel (``reduce="kernel"``).

    ``tma`` (one split only): "w" streams the weight tiles through Hopper's tensor memory accelerator
    (kernels/linear/tma.py), "xw" the x tiles too; "off" (the default) the pointer kernel's cp.async loads.
    A launch TMA cannot take (pre-Hopper, unaligned operands) runs the pointer kernel."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    reduce: str = "arrive"
    tma: str = "off"

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's smallest tile), got {v}")
        if not 1 <= self.split_k <= 64:
            raise ValueError(f"split_k must be in [1, 64], got {self.split_k}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be a power of two <= 16, got {self.num_warps}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages must be in [1, 8], got {self.num_stages}")
        if self.reduce not in REDUCES:
            raise ValueError(f"reduce must be one of {REDUCES}, got {self.reduce!r}")
        if self.tma not in TMA_MODES:
            raise ValueError(f"tma must be one of {TMA_MODES}, got {self.tma!r}")
        if self.tma != "off" and self.split_k != 1:
            raise ValueError(f"tma={self.tma!r} runs one split, got split_k={self.split_k}")

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        """Shared memory the pipelined x and w tiles take (what Triton allocates for the K loop)."""
        return self.num_stages * (self.block_m + self.block_n) * self.block_k * elem_bytes

    def short(self) -> str:
        """A compact name for tables: m16 n64 k128 s2 w4 st4 (+ 'K' when split partials are reduced by a kernel,
        + ' tma-w' / ' tma-xw' with TMA)."""
        red = "K" if self.split_k > 1 and self.reduce == "kernel" else ""
        tma = f" tma-{self.tma}" if self.tma != "off" else ""
        return (f"m{self.block_m} n{self.block_n} k{self.block_k} s{self.split_k}{red} "
                f"w{self.num_warps} st{self.num_stages}{tma}")

    def literal(self) -> str:
        """The config as Python source, in the form this module's CONFIGS table holds it."""
        extra = f", reduce={self.reduce!r}" if self.split_k > 1 and self.reduce != "arrive" else ""
        extra += f", tma={self.tma!r}" if self.tma != "off" else ""
        return (f"LinearConfig({self.block_m}, {self.block_n}, {self.block_k}, split_k={self.split_k}, "
                f"num_warps={self.num_warps}, num_stages={self.num_stages}{extra})")


def _c(m, n, k, stages):
    return LinearConfig(m, n, k, split_k=1, num_warps=4, num_stages=stages)


def _TMA(m, n, k, stages):  # noqa: N802
    return LinearConfig(m, n, k, split_k=1, num_warps=4, num_stages=stages, tma="xw")


# Measured on an H100 by bench/skinny_gemm/skinny_gemm.py (bench/skinny_gemm/README.md): the fastest config per
# Llama-3-8B projection (N, K) and row count, as ((largest M, config), ...) in ascending M; None where cuBLAS
# was faster (the caller keeps cuBLAS there). q|k|v and o at 64 rows, where the two were level (20.6 against
# 20.5 us, 14.8 against 14.9 us), go to the kernel. Shapes or M past the last entry fall back to the kernel's heuristic.
# The 64-row entries stream their tiles by TMA (``tma="xw"``): the same bits as the pointer kernel and 0.5-2.5%
# faster per launch, the 32-layer stack 5.29 -> 5.20 ms (bench/skinny_gemm/skinny_gemm.py --tma-ab;
# bench/skinny_gemm/README.md).
CONFIGS: dict[tuple[int, int], tuple[tuple[int, LinearConfig | None], ...]] = {
    (6144, 4096): ((1, _c(16, 64, 256, 3)), (8, _c(16, 64, 256, 3)), (32, _c(32, 64, 128, 5)),
                   (64, _TMA(64, 64, 128, 5)), (128, None)),
    (4096, 4096): ((1, _c(16, 32, 256, 5)), (8, _c(16, 32, 128, 5)), (32, None), (64, _TMA(64, 32, 256, 4)),
                   (128, None)),
    (28672, 4096): ((1, _c(16, 128, 256, 3)), (8, _c(16, 128, 256, 3)), (32, _c(32, 128, 128, 4)),
                    (64, _TMA(64, 64, 128, 3)), (128, None)),
    (4096, 14336): ((1, _c(16, 32, 256, 5)), (8, _c(16, 32, 256, 5)), (32, _c(32, 32, 256, 5)),
                    (64, _TMA(64, 32, 128, 8)), (128, _c(64, 64, 128, 5))),
    (128256, 4096): ((1, _c(16, 64, 256, 4)), (8, _c(16, 64, 256, 4)), (32, _c(32, 128, 128, 4)),
                     (64, _c(64, 128, 128, 3)), (128, LinearConfig(128, 128, 128, split_k=1, num_warps=8, num_stages=3))),
}
_UNLISTED = object()


def table_config(m: int, n: int, k: int):
    """The table's entry for an M x (N, K) GEMM: a LinearConfig, None (cuBLAS is faster there), or
    ``_UNLISTED`` (no measurement: the kernel's heuristic)."""
    for max_m, cfg in CONFIGS.get((n, k), ()):
        if m <= max_m:
            return cfg
    return _UNLISTED
