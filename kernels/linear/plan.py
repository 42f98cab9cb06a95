"""Host-side planning of the skinny-GEMM launches (kernels/linear/triton.py): the config a shape gets (the
measured table, else a heuristic), the fused gate|up variant of it, the K split plan, and the per-device
arrival counters of split-K launches reduced by their last program."""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton

from kernels.counters import ArrivalCounters
from kernels.linear.config import LinearConfig, table_config
from kernels.options import current

MAX_TILES_COUNTED = 1 << 16  # per-tile arrival counters kept per device (a launch with more gets its own)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (132 for an H100 SXM, assumed off CUDA)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 132


def heuristic_config(m: int, n: int, k: int, sms: int = 132) -> LinearConfig:
    """A config for a shape the table does not hold: one M tile up to 64 rows, 64-wide N tiles, and
    enough K splits (each of at least 4 block_k steps) for ~2 programs per SM."""
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    block_n, block_k = 64, min(128, max(16, triton.next_power_of_2(k)))
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = 1
    while split < 8 and tiles * split * 2 <= 2 * sms and k // (block_k * split * 2) >= 4:
        split *= 2
    return LinearConfig(block_m, block_n, block_k, split_k=split, num_warps=4, num_stages=4)


def pick_config(m: int, n: int, k: int, sms: int = 132) -> LinearConfig:
    """The table's config for (N, K) and the smallest listed M bound >= m, else the heuristic (also where
    the table prefers cuBLAS: a caller asking the kernel anyway gets a working launch)."""
    cfg = table_config(m, n, k)
    cfg = cfg if isinstance(cfg, LinearConfig) else heuristic_config(m, n, k, sms)
    return cfg if cfg.tma == "off" or current().tma else dataclasses.replace(cfg, tma="off")


_COUNTERS = ArrivalCounters(MAX_TILES_COUNTED)


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed per-tile arrival counters, each reset to 0 by the program that reduces its tile
    (kernels/counters.py)."""
    return _COUNTERS.get(device, tiles)


def split_plan(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(K elements per split, a multiple of block_k; number of non-empty splits)."""
    steps = triton.cdiv(k, block_k)
    per = triton.cdiv(steps, split_k) * block_k
    return per, triton.cdiv(k, per)


def swiglu_config(m: int, inter: int, k: int, sms: int = 132) -> LinearConfig:
    """The fused gate|up launch: the table's config for the unfused [2*inter, K] projection with half as many
    output columns a tile (each tile streams as many weight rows, gate and up), one split."""
    cfg = pick_config(m, 2 * inter, k, sms)
    return dataclasses.replace(cfg, block_n=max(16, cfg.block_n // 2), split_k=1)
