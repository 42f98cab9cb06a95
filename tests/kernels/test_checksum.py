"""The CRC-32 kernel and its twin against zlib, on random bytes of awkward lengths and places."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from kernels.checksum import crc0_spans, crc32_of_crc0, crc32_spans
from kernels.checksum.reference import BLOCK_WORDS, LANES, PIECE, kernel_tables, mulmod


def _spans(rng, size: int) -> tuple[list[int], list[int]]:
    block, big = 4 * BLOCK_WORDS, LANES * PIECE        # the twin's block and the kernel's
    lengths = [0, 1, 3, 4, 5, PIECE + 1, block - 1, block, block + 1, big - 1, big, 2 * big + 7, size - 11]
    starts = [int(rng.integers(0, size - n + 1)) for n in lengths]
    return starts, lengths


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_crc32_of_each_span_is_zlibs(backend):
    """On the device (crc32_spans), and as each span's crc0 (one kernel) finished on the host (crc32_of_crc0)."""
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, 3 * LANES * PIECE + 13, dtype=np.uint8)
    starts, lengths = _spans(rng, data.size)
    got = crc32_spans(torch.from_numpy(data), starts, lengths, backend=backend)
    assert got.dtype == torch.int32 and got.shape == (len(starts),)
    want = [zlib.crc32(data[s:s + n].tobytes()) for s, n in zip(starts, lengths)]
    assert [x & 0xFFFFFFFF for x in got.tolist()] == want
    raw = crc0_spans(torch.from_numpy(data), starts, lengths, backend=backend)
    assert raw.dtype == torch.int32 and crc32_of_crc0(raw.tolist(), lengths) == want


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_one_flipped_bit_changes_the_crc(backend):
    rng = np.random.default_rng(8)
    data = torch.from_numpy(rng.integers(0, 256, 5000, dtype=np.uint8))
    before = crc32_spans(data, [0], [5000], backend=backend)
    data[2345] ^= 4
    after = crc32_spans(data, [0], [5000], backend=backend)
    assert before.item() != after.item()
    assert after.item() & 0xFFFFFFFF == zlib.crc32(data.numpy().tobytes())


def test_bad_spans_are_refused():
    data = torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(ValueError, match="not within"):
        crc32_spans(data, [90], [11])
    with pytest.raises(ValueError, match="not within"):
        crc0_spans(data, [90], [11])
    with pytest.raises(ValueError, match="uint8 vector"):
        crc32_spans(data.view(torch.int32), [0], [4])
    with pytest.raises(ValueError, match="starts for"):
        crc32_spans(data, [0, 1], [4])
    with pytest.raises(ValueError, match="unknown checksum backend"):
        crc32_spans(data, [0], [4], backend="cuda")


def test_the_kernels_tables_multiply_as_powers_of_x():
    """mulmod by the polynomial 1 is the identity, lane constants step by x^(8 PIECE), and each power is the square of
    the one before."""
    _, lanes, powers = (t.view(np.uint32).astype(np.int64) for t in kernel_tables())
    assert mulmod(0x12345678, 0x80000000) == 0x12345678 and lanes[-1] == 0x80000000
    step = int(lanes[-2])
    assert all(mulmod(int(lanes[i + 1]), step) == lanes[i] for i in range(LANES - 1))
    assert all(mulmod(int(powers[k]), int(powers[k])) == powers[k + 1] for k in range(31))
    assert mulmod(int(lanes[0]), step) == powers[0]
