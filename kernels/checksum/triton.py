"""The CRC-32 kernel: one program per 16 KiB block of a span. Each of its 256 lanes runs a 64-byte piece through the
register a word at a time (four table lookups a word); the pieces' registers are multiplied by their places' powers
of x (carry-less products, XORed, then reduced mod P once), the block's by its place in the span, and XORed into the
span's result."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.checksum.reference import LANES, PIECE, kernel_tables


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _step(x, slices):
    """The register x (uint32) advanced over four zero bytes: x times x^32 mod P."""
    t3 = tl.load(slices + (x & 0xFF).to(tl.int32))
    t2 = tl.load(slices + 256 + ((x >> 8) & 0xFF).to(tl.int32))
    t1 = tl.load(slices + 512 + ((x >> 16) & 0xFF).to(tl.int32))
    t0 = tl.load(slices + 768 + (x >> 24).to(tl.int32))
    return (t3 ^ t2 ^ t1 ^ t0).to(tl.uint32, bitcast=True)


@triton.jit
def _clmul(a, b):
    """Carry-less product of uint32 a and b, as uint64."""
    a64 = a.to(tl.uint64)
    p = a64 ^ a64
    for j in tl.static_range(32):
        p = p ^ tl.where(((b >> j) & 1) == 1, a64 << j, p ^ p)
    return p


@triton.jit
def _reduce(p, slices):
    """A carry-less product mod P (reference.mulmod)."""
    u = p << 1
    return _step(u.to(tl.uint32), slices) ^ (u >> 32).to(tl.uint32)


@triton.jit
def _crc_blocks(data, starts, lengths, slices, lanes, powers, out, LANES: tl.constexpr, PIECE: tl.constexpr):
    q = tl.program_id(0)
    s = tl.program_id(1)
    start = tl.load(starts + s)
    n = tl.load(lengths + s)
    block = LANES * PIECE
    nb = (n + block - 1) // block
    if q < nb:
        pad = nb * block - n                        # zero bytes before the span (left padding: crc0 unchanged)
        first = q * block + tl.arange(0, LANES) * PIECE - pad
        c = tl.zeros([LANES], dtype=tl.uint32)
        for m in tl.static_range(PIECE // 4):
            w = tl.zeros([LANES], dtype=tl.uint32)
            for b in tl.static_range(4):
                at = first + 4 * m + b
                byte = tl.load(data + start + at, mask=(at >= 0) & (at < n), other=0)
                w = w | (byte.to(tl.uint32) << (8 * b))
            c = _step(c ^ w, slices)
        k = tl.load(lanes + tl.arange(0, LANES)).to(tl.uint32, bitcast=True)
        x = _reduce(tl.reduce(_clmul(c, k), 0, _xor), slices)      # the block's own crc0
        shift = nb - 1 - q                          # blocks after this one
        j = 0
        while shift > 0:
            if (shift & 1) == 1:
                x = _reduce(_clmul(x, tl.load(powers + j).to(tl.uint32, bitcast=True)), slices)
            shift = shift >> 1
            j += 1
        tl.atomic_xor(out + s, x.to(tl.int32, bitcast=True))     # 32-bit atomics: every Triton has them


@functools.lru_cache(maxsize=8)
def _tables(device: str) -> tuple[torch.Tensor, ...]:
    return tuple(torch.from_numpy(t).to(device) for t in kernel_tables())


@functools.lru_cache(maxsize=256)
def _spans(device: str, starts: tuple, lengths: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The spans on the device, kept: a chunk's layers give the same spans every time."""
    return (torch.tensor(starts, dtype=torch.int64).to(device), torch.tensor(lengths, dtype=torch.int64).to(device))


def crc0_spans(data: torch.Tensor, starts: list[int], lengths: list[int]) -> torch.Tensor:
    device = str(data.device)
    crc0 = torch.zeros(len(starts), dtype=torch.int32, device=data.device)
    if starts and max(lengths) > 0:
        st, ln = _spans(device, tuple(starts), tuple(lengths))
        grid = (-(-max(lengths) // (LANES * PIECE)), len(starts))
        _crc_blocks[grid](data, st, ln, *_tables(device), crc0, LANES=LANES, PIECE=PIECE)
    return crc0
