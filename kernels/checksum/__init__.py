"""CRC-32 (zlib's) of byte spans on the GPU, so bytes that landed there are checked where they landed.

CRC-32 is linear over GF(2) once its initial and final inversions are taken out: with ``crc0`` the register's value
after the message from a zero register, ``zlib.crc32(m) = crc0(m) ^ zlib.crc32(bytes(len(m)))``, and leading zero
bytes leave ``crc0`` unchanged, so a span is left-padded to whole blocks and its blocks are checked independently:
the register of a piece followed by d bytes contributes its value times x^(8d) mod P.
- The kernel (``triton.py``): a program per 16 KiB block, a lane per 64-byte piece run through the register a word
  at a time (four lookups in ``reference.kernel_tables``' slices); each piece's register times its power of x (a
  carry-less product; the block's products XORed, then reduced mod P once), the block's times its own power (the
  squarings x^(8 * 16 KiB * 2^k)), XORed into the span's result with one atomic.
- Its plain-torch twin (``reference.py``): the same function as bit matrices: word i of a 1 KiB block contributes
  ``S^(B-i) w`` (S: the register advanced over four zero bytes, a 32x32 bit matrix), each sum written as parities.

    crc32_spans(data, starts, lengths) -> int32 [L]: zlib.crc32 of data[starts[i]:starts[i] + lengths[i]]
    crc0_spans(data, starts, lengths) -> int32 [L]: each span's crc0, which ``crc32_of_crc0`` turns into the CRC-32
        on the host (a caller that reads the values there anyway saves the finishing kernels)
"""

from __future__ import annotations

import torch

from kernels.checksum import reference

__all__ = ["crc0_spans", "crc32_of_crc0", "crc32_spans"]


def _impl(backend: str):
    if backend == "torch":
        return reference
    if backend == "triton":
        from kernels.checksum import triton as impl

        return impl
    raise ValueError(f"unknown checksum backend {backend!r} (torch or triton)")


def _check(data: torch.Tensor, starts: list[int], lengths: list[int]) -> None:
    if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
        raise ValueError(f"data must be a contiguous uint8 vector, got {data.dtype} of shape {tuple(data.shape)}")
    if len(starts) != len(lengths):
        raise ValueError(f"{len(starts)} starts for {len(lengths)} lengths")
    for s, n in zip(starts, lengths):
        if s < 0 or n < 0 or s + n > data.numel():
            raise ValueError(f"span [{s}, {s + n}) is not within the data's {data.numel()} bytes")


def crc32_spans(data: torch.Tensor, starts: list[int], lengths: list[int], backend: str = "torch") -> torch.Tensor:
    """data uint8 [N] -> int32 [L] on data's device (no host sync): the CRC-32 of each span (two's complement: ``&
    0xFFFFFFFF`` gives zlib's value). Spans may overlap; an empty span's CRC is 0."""
    _check(data, starts, lengths)
    crc0 = _impl(backend).crc0_spans(data, list(starts), list(lengths))
    return reference.finish(crc0.to(torch.int64) & 0xFFFFFFFF, list(lengths))


def crc0_spans(data: torch.Tensor, starts: list[int], lengths: list[int], backend: str = "torch") -> torch.Tensor:
    """As ``crc32_spans`` but each span's crc0 (the register after the span from a zero register), int32 on data's
    device: one kernel and no finishing ones."""
    _check(data, starts, lengths)
    return _impl(backend).crc0_spans(data, list(starts), list(lengths))


def crc32_of_crc0(crc0: list[int], lengths: list[int]) -> list[int]:
    """On the host: the CRC-32s (zlib's, unsigned) of spans of ``lengths`` bytes from their ``crc0_spans`` values."""
    return [(c & 0xFFFFFFFF) ^ reference.zeros_crc(n) for c, n in zip(crc0, lengths)]
