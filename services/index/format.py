"""The attention index's bytes: a fixed header, a digest, then the payload.

Layout (little-endian)::

    header   magic b"TSRAIDX\\0" | version u16 | key dtype u16 | dim u32 | num_keys u64 | num_edges u64
             | num_entries u64 | config_len u32
    digest   blake2b-256 of header + payload
    payload  config (JSON, config_len bytes) | keys [N, D] | offsets int64 [N + 1] | targets int32 [E]
             | entries int64 [num_entries]

The key dtype is 0 for float32 keys, 1 for bfloat16 (their bits, ``half.py``); the field was reserved, 0, before
bfloat16 keys were held, so every earlier blob reads as float32. Version 2 holds several entries (a composed index's);
version 1 blobs (one entry) are refused.

``decode`` checks, in this order, the length, the magic, the version, that the sizes the header names add
up to the blob exactly, the digest, then the graph's structure; any failure raises ``IndexFormatError``
before an index exists, so a damaged or foreign blob never becomes a wrong index.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

import numpy as np

from services.index import half

MAGIC = b"TSRAIDX\x00"
VERSION = 2
_HEADER = struct.Struct("<8sHHIQQQI")
DIGEST_BYTES = 32
KEY_DTYPES = {0: ("<f4", np.float32), 1: ("<u2", np.uint16)}     # the header's key dtype code: (bytes, array dtype)


class IndexFormatError(ValueError):
    """A blob that is not a whole, intact index of this format version."""


@dataclass(frozen=True, slots=True)
class IndexParts:
    """What a blob holds: keys ``[N, D]`` (float32, or bfloat16 bits: uint16), the CSR graph (offsets int64
    ``[N + 1]``, targets int32 ``[E]``), the keys a search starts from (entries int64) and the build options as a JSON
    object."""

    keys: np.ndarray
    offsets: np.ndarray
    targets: np.ndarray
    entries: np.ndarray
    config: dict


def _digest(header: bytes, payload: list[bytes]) -> bytes:
    h = hashlib.blake2b(header, digest_size=DIGEST_BYTES)
    for part in payload:
        h.update(part)
    return h.digest()


def sealed(header: bytes, payload: list[bytes]) -> bytes:
    """A blob: the header, the blake2b digest of header and payload, the payload's parts."""
    return b"".join([header, _digest(header, payload), *payload])


def unsealed(view: memoryview, header_size: int, sizes: list[int], what: str) -> list[memoryview]:
    """The payload parts of ``sizes`` bytes after a header and its digest, once the blob's length and digest are
    checked: IndexFormatError naming ``what`` otherwise."""
    start = header_size + DIGEST_BYTES
    if start + sum(sizes) != len(view):
        raise IndexFormatError(f"{what} holds {len(view)} bytes, its header describes {start + sum(sizes)}")
    payload, at = [], start
    for size in sizes:
        payload.append(view[at: at + size])
        at += size
    if bytes(view[header_size: start]) != _digest(bytes(view[:header_size]), payload):
        raise IndexFormatError(f"{what} digest does not match its contents (corrupt blob)")
    return payload


def encode(parts: IndexParts) -> bytes:
    n, d = parts.keys.shape
    config = json.dumps(parts.config, sort_keys=True).encode()
    code = 1 if parts.keys.dtype == half.BITS else 0
    header = _HEADER.pack(MAGIC, VERSION, code, d, n, parts.targets.shape[0], parts.entries.shape[0], len(config))
    payload = [config, parts.keys.astype(KEY_DTYPES[code][0]).tobytes(), parts.offsets.astype("<i8").tobytes(),
               parts.targets.astype("<i4").tobytes(), parts.entries.astype("<i8").tobytes()]
    return sealed(header, payload)


def decode(blob: bytes) -> IndexParts:
    view = memoryview(blob)
    if len(view) < _HEADER.size + DIGEST_BYTES:
        raise IndexFormatError(f"blob of {len(view)} bytes is shorter than an index header")
    header = bytes(view[: _HEADER.size])
    magic, version, code, d, n, e, n_entries, config_len = _HEADER.unpack(header)
    if magic != MAGIC:
        raise IndexFormatError("blob is not an attention index (bad magic)")
    if version != VERSION:
        raise IndexFormatError(f"index format version {version}, this build reads version {VERSION} only")
    if code not in KEY_DTYPES:
        raise IndexFormatError(f"key dtype code is {code}, this build reads {sorted(KEY_DTYPES)}")
    wire, dtype = KEY_DTYPES[code]
    sizes = [config_len, np.dtype(wire).itemsize * n * d, 8 * (n + 1), 4 * e, 8 * n_entries]
    payload = unsealed(view, _HEADER.size, sizes, "index")
    try:
        config = json.loads(bytes(payload[0]))
    except ValueError as exc:
        raise IndexFormatError(f"index options are not JSON: {exc}") from None
    keys = np.frombuffer(payload[1], dtype=wire).reshape(n, d).astype(dtype)
    offsets = np.frombuffer(payload[2], dtype="<i8").astype(np.int64)
    targets = np.frombuffer(payload[3], dtype="<i4").astype(np.int32)
    entries = np.frombuffer(payload[4], dtype="<i8").astype(np.int64)
    check_graph(keys, offsets, targets, entries)
    if not isinstance(config, dict):
        raise IndexFormatError("index options are not a JSON object")
    return IndexParts(keys, offsets, targets, entries, config)


def check_graph(keys: np.ndarray, offsets: np.ndarray, targets: np.ndarray, entries: np.ndarray) -> None:
    """The invariants the compiled search relies on (``_search.py``): raise ``IndexFormatError`` if any fails."""
    if keys.shape[0] < 1 or keys.shape[1] < 1:
        raise IndexFormatError(f"index holds keys of shape {keys.shape}")
    if not (half.finite(keys) if keys.dtype == half.BITS else np.isfinite(keys).all()):
        raise IndexFormatError("index keys hold non-finite values")
    check_structure(keys.shape[0], offsets, targets, entries)


def check_structure(n: int, offsets: np.ndarray, targets: np.ndarray, entries: np.ndarray) -> None:
    """A graph over ``n`` keys: CSR offsets of them, targets among them, distinct int64 entries among them."""
    if offsets.shape != (n + 1,) or offsets[0] != 0 or offsets[-1] != targets.shape[0] or (np.diff(offsets) < 0).any():
        raise IndexFormatError("index graph offsets are not a CSR of its keys")
    if targets.size and (targets.min() < 0 or targets.max() >= n):
        raise IndexFormatError("index graph links to a key it does not hold")
    if entries.ndim != 1 or entries.shape[0] < 1 or entries.dtype != np.int64:
        raise IndexFormatError(f"index entries must be int64 [>= 1], got {entries.dtype} {entries.shape}")
    if entries.min() < 0 or entries.max() >= n:
        raise IndexFormatError(f"an index entry is not one of its {n} keys")
    if np.unique(entries).shape[0] != entries.shape[0]:
        raise IndexFormatError("index entries repeat a key")
