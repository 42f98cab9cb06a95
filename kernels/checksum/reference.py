"""The plain-torch twin of the CRC-32 kernel (bit matrices), and the kernel's tables (the package's docstring gives both
methods)."""

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


PIECE = 64                   # the kernel: bytes a lane runs through the register one word at a time
LANES = 256                  # the kernel: lanes of a program; a program's block is PIECE * LANES bytes (16 KiB)


def _advance(r: int, nbytes: int) -> int:
    """r times x^(8 nbytes) mod P: the register advanced over nbytes zero bytes."""
    t = _byte_table()
    for _ in range(nbytes):
        r = int(t[r & 0xFF]) ^ (r >> 8)
    return r


def _clmul(a: int, b: int) -> int:
    out = 0
    for j in range(32):
        if (b >> j) & 1:
            out ^= a << j
    return out


def mulmod(a: int, b: int) -> int:
    """A·B mod P of two registers: the carry-less product (63 bits, one more to the left in the reflected order), its
    upper word advanced over four zero bytes into the lower."""
    u = _clmul(a, b) << 1
    return _advance(u & 0xFFFFFFFF, 4) ^ (u >> 32)


def _signed(values) -> np.ndarray:
    return np.array(values, dtype=np.uint32).view(np.int32)


@functools.cache
def kernel_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(slices [4, 256]: T advanced over 3, 2, 1 and 0 more bytes, a word's step in four lookups; lanes [LANES]:
    x^(8 PIECE (LANES-1-l)) mod P, what lane l's piece is multiplied by within its block; powers [32]:
    x^(8 PIECE LANES 2^k) mod P, the block shifts), as int32."""
    t = [int(v) for v in _byte_table()]
    slices = [[_advance(v, k) for v in t] for k in (3, 2, 1, 0)]
    one = 0x80000000                        # the polynomial 1, reflected
    piece = _advance(one, PIECE)
    lanes, power = [], one
    for _ in range(LANES):
        lanes.append(power)
        power = mulmod(power, piece)
    powers = [power]                        # x^(8 PIECE LANES)
    for _ in range(31):
        powers.append(mulmod(powers[-1], powers[-1]))
    return _signed(slices), _signed(lanes[::-1]), _signed(powers)


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


@functools.lru_cache(maxsize=256)
def _zeros_crcs(device: str, lengths: tuple) -> torch.Tensor:
    return torch.tensor([zeros_crc(n) for n in lengths], dtype=torch.int64).to(device)


def finish(crc0: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """int64 crc0 per span -> int32 CRC-32 per span."""
    out = crc0 ^ _zeros_crcs(str(crc0.device), tuple(lengths))
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def _xor_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """XOR of int64 values < 2^32 along ``dim``, as the parity of each bit."""
    bits = (x.unsqueeze(-1) >> torch.arange(32, device=x.device)) & 1
    parity = bits.sum(dim) & 1
    return (parity << torch.arange(32, device=x.device)).sum(-1)


def crc0_spans(data: torch.Tensor, starts: list[int], lengths: list[int]) -> torch.Tensor:
    """Each span's crc0 as int32 (two's complement)."""
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
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)
