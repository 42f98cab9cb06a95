"""The plain-torch twin of the CRC-32 kernel, and the tables both use (the package's docstring gives the method)."""

from __future__ import annotations

import functools
import zlib

import numpy as np
import torch

BLOCK_WORDS = 256            # 32-bit words per block: 1 KiB
_POLY = 0xEDB88320           # CRC-32, reflected


@functools.cache
def _byte_table() -> np.ndarray:
    t = np.arange(256, dtype=np.uint64)
    for _ in range(8):
        t = np.where(t & 1, (t >> np.uint64(1)) ^ np.uint64(_POLY), t >> np.uint64(1))
    return t


def _advance_word(x: np.ndarray) -> np.ndarray:
    """S: the register advanced over four zero bytes (elementwise)."""
    t = _byte_table()
    for _ in range(4):
        x = (x >> np.uint64(8)) ^ t[x & np.uint64(0xFF)]
    return x


def _apply(m: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The 32x32 bit matrix m (its columns: the images of bits 0..31) applied to each value of x."""
    bits = (x[..., None] >> np.arange(32, dtype=np.uint64)) & np.uint64(1)
    return np.bitwise_xor.reduce(np.where(bits == 1, m, np.uint64(0)), axis=-1)


@functools.cache
def tables() -> tuple[np.ndarray, np.ndarray]:
    """(words [BLOCK_WORDS, 32]: column j of S^(B-i), i.e. the image of bit j of word i of a block in the block's
    crc0; powers [32, 32]: the columns of S^(B 2^k)), as int64."""
    v = np.uint64(1) << np.arange(32, dtype=np.uint64)
    words = np.empty((BLOCK_WORDS, 32), dtype=np.uint64)
    for i in range(BLOCK_WORDS - 1, -1, -1):
        v = _advance_word(v)
        words[i] = v
    powers = np.empty((32, 32), dtype=np.uint64)
    powers[0] = words[0]                    # S^B
    for k in range(1, 32):
        powers[k] = _apply(powers[k - 1], powers[k - 1])
    return words.astype(np.int64), powers.astype(np.int64)


@functools.lru_cache(maxsize=64)
def zeros_crc(n: int) -> int:
    """zlib.crc32 of n zero bytes: what turns a span's crc0 into its CRC-32."""
    return zlib.crc32(bytes(n))


def device_tables(device) -> tuple[torch.Tensor, torch.Tensor]:
    return _device_tables(str(torch.device(device)))


@functools.cache
def _device_tables(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    words, powers = tables()
    return torch.from_numpy(words).to(device), torch.from_numpy(powers).to(device)


def finish(crc0: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """int64 crc0 per span -> int32 CRC-32 per span."""
    z = torch.tensor([zeros_crc(n) for n in lengths], dtype=torch.int64).to(crc0.device, non_blocking=True)
    out = crc0 ^ z
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def _xor_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """XOR of int64 values < 2^32 along ``dim``, as the parity of each bit."""
    bits = (x.unsqueeze(-1) >> torch.arange(32, device=x.device)) & 1
    parity = bits.sum(dim) & 1
    return (parity << torch.arange(32, device=x.device)).sum(-1)


def crc32_spans(data: torch.Tensor, starts: list[int], lengths: list[int]) -> torch.Tensor:
    words, powers = device_tables(data.device)
    out = torch.zeros(len(starts), dtype=torch.int64, device=data.device)
    for s, (start, n) in enumerate(zip(starts, lengths)):
        if n == 0:
            continue
        nw = -(-n // 4)
        nb = -(-nw // BLOCK_WORDS)
        pad = nb * BLOCK_WORDS * 4 - n                          # zero bytes before the span: crc0 unchanged
        padded = torch.zeros(nb * BLOCK_WORDS * 4, dtype=torch.int64, device=data.device)
        padded[pad:] = data[start:start + n].to(torch.int64)
        w = padded.view(nb, BLOCK_WORDS, 4)
        w = w[..., 0] | (w[..., 1] << 8) | (w[..., 2] << 16) | (w[..., 3] << 24)      # [nb, B]
        bits = (w.unsqueeze(-1) >> torch.arange(32, device=data.device)) & 1           # [nb, B, 32]
        block = _xor_sum(torch.where(bits == 1, words, 0).view(nb, -1), 1)             # [nb]: each block's crc0
        shift = nb - 1 - torch.arange(nb, device=data.device)
        for k in range(max(1, int(nb - 1).bit_length())):
            m = ((shift >> k) & 1) == 1
            if m.any():
                b = (block[m].unsqueeze(-1) >> torch.arange(32, device=data.device)) & 1
                block[m] = _xor_sum(torch.where(b == 1, powers[k], 0), 1)
        out[s] = _xor_sum(block, 0)
    return finish(out, lengths)
