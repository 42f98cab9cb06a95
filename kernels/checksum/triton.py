"""The CRC-32 kernel: one program per (block, span); each XORs its block's contribution into its span's crc0."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checksum.reference import BLOCK_WORDS, device_tables, finish


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _crc_blocks(data, starts, lengths, words, powers, out, B: tl.constexpr):
    q = tl.program_id(0)
    s = tl.program_id(1)
    start = tl.load(starts + s)
    n = tl.load(lengths + s)
    nb = (n + 4 * B - 1) // (4 * B)
    if q < nb:
        pad = nb * B * 4 - n                        # zero bytes before the span (left padding: crc0 unchanged)
        i = tl.arange(0, B)
        first = (q * B + i) * 4 - pad               # each word's first byte within the span
        w = tl.zeros([B], dtype=tl.int64)
        for k in tl.static_range(4):
            at = first + k
            byte = tl.load(data + start + at, mask=(at >= 0) & (at < n), other=0)
            w = w | (byte.to(tl.int64) << (8 * k))
        j = tl.arange(0, 32)
        bits = (w[:, None] >> j[None, :]) & 1
        table = tl.load(words + i[:, None] * 32 + j[None, :])
        x = tl.reduce(tl.reduce(tl.where(bits == 1, table, 0), 1, _xor), 0, _xor)     # the block's own crc0
        shift = nb - 1 - q                          # blocks after this one: x goes through S^(B shift)
        k = 0
        while shift > 0:
            if (shift & 1) == 1:
                m = tl.load(powers + k * 32 + j)
                x = tl.reduce(tl.where(((x >> j) & 1) == 1, m, 0), 0, _xor)
            shift = shift >> 1
            k += 1
        tl.atomic_xor(out + s, x.to(tl.int32))     # 32-bit atomics: every Triton has them


def crc32_spans(data: torch.Tensor, starts: list[int], lengths: list[int]) -> torch.Tensor:
    words, powers = device_tables(data.device)
    crc0 = torch.zeros(len(starts), dtype=torch.int32, device=data.device)
    if starts and max(lengths) > 0:
        st = torch.tensor(starts, dtype=torch.int64).to(data.device, non_blocking=True)
        ln = torch.tensor(lengths, dtype=torch.int64).to(data.device, non_blocking=True)
        grid = (-(-max(lengths) // (4 * BLOCK_WORDS)), len(starts))
        _crc_blocks[grid](data, st, ln, words, powers, crc0, B=BLOCK_WORDS)
    return finish(crc0.to(torch.int64) & 0xFFFFFFFF, lengths)
