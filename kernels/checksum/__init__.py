"""CRC-32 (zlib's) of byte spans on the GPU, so bytes that landed there are checked where they landed.

CRC-32 is linear over GF(2) once its initial and final inversions are taken out: with ``crc0`` the register's value
after the message from a zero register, ``zlib.crc32(m) = crc0(m) ^ zlib.crc32(bytes(len(m)))``, and leading zero
bytes leave ``crc0`` unchanged. A message left-padded to whole blocks of ``BLOCK_WORDS`` little-endian 32-bit words
then splits into blocks checked independently: word i of a block contributes ``S^(B-i) w`` to the block's own
``crc0`` (S: the register advanced over four zero bytes, a 32x32 bit matrix), and block q of nb contributes
``S^(B(nb-1-q))`` of that, applied as a product of the squarings ``S^(B 2^k)``. Both tables are made once on the CPU
(``reference.tables``). The kernel (``triton.py``) gives each block a program and XORs its contribution into the
span's result; ``reference.py`` is its plain-torch twin, the same sums written as parities.

    crc32_spans(data, starts, lengths) -> int32 [L]: zlib.crc32 of data[starts[i]:starts[i] + lengths[i]]
"""

from __future__ import annotations

import torch

from kernels.checksum import reference

__all__ = ["crc32_spans"]


def _impl(backend: str):
    if backend == "torch":
        return reference
    if backend == "triton":
        from kernels.checksum import triton as impl

        return impl
    raise ValueError(f"unknown checksum backend {backend!r} (torch or triton)")


def crc32_spans(data: torch.Tensor, starts: list[int], lengths: list[int], backend: str = "torch") -> torch.Tensor:
    """data uint8 [N] -> int32 [L] on data's device (no host sync): the CRC-32 of each span (two's complement: ``&
    0xFFFFFFFF`` gives zlib's value). Spans may overlap; an empty span's CRC is 0."""
    if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
        raise ValueError(f"data must be a contiguous uint8 vector, got {data.dtype} of shape {tuple(data.shape)}")
    if len(starts) != len(lengths):
        raise ValueError(f"{len(starts)} starts for {len(lengths)} lengths")
    for s, n in zip(starts, lengths):
        if s < 0 or n < 0 or s + n > data.numel():
            raise ValueError(f"span [{s}, {s + n}) is not within the data's {data.numel()} bytes")
    return _impl(backend).crc32_spans(data, list(starts), list(lengths))
