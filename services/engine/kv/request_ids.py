"""Reading a request's token ids: conversion, the integer check, and the chunks already seen.

A RAG engine sees the same documents again and again. Converting a chunk's ids to an array, checking
them and hashing them into its chunk id costs ~40 us of host time per 512 tokens, before the GPU has
any work: ``KnownChunks`` remembers, by content, the chunk token lists this engine has checked, so a
chunk seen before costs a tuple, a dict lookup and one sum (~8 us).
"""

from __future__ import annotations

import operator
import threading
from collections import OrderedDict
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass

import numpy as np
import torch

KNOWN_CHUNK_TOKENS = 1 << 18  # ~10 MB of keys: more chunks than a GPU's KV pool holds at 8B scale


def part_ids(part, where: str) -> tuple[list[int], np.ndarray | None]:
    """One part of a request as a list of ints and an int64 array (None when some id does not fit int64,
    so is past any vocabulary). An id that is not an integer (a float, a string, a bool array) is refused
    by name, never truncated. A list numpy reads as integers is returned as given (no copy)."""
    if isinstance(part, torch.Tensor):
        part = part.detach().cpu().numpy()  # (a device tensor's ids come over once)
    try:
        arr = np.array(part)  # dtype inferred: a float or string id shows in it
    except (OverflowError, TypeError, ValueError):
        arr = None
    if arr is not None and arr.ndim == 1 and (arr.dtype.kind in "iu" or arr.size == 0):
        ids = part if type(part) is list else arr.tolist()
        if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
            return ids, None
        return ids, arr.astype(np.int64, copy=False)
    ids = []  # an iterator, a device tensor, mixed or non-integer ids: one by one, the offender named
    for t in part:
        try:
            ids.append(operator.index(t))
        except TypeError:
            raise ValueError(f"token id {t!r} in {where} is not an integer") from None
    try:
        return ids, np.asarray(ids, dtype=np.int64)
    except OverflowError:
        return ids, None


def request_ids(chunks, suffix, names: list[str] | None = None) -> tuple[list[list[int]], list[int], np.ndarray | None]:
    """The request's parts as lists of ints, and every id, chunks then suffix, in one int64 array (None
    only when some id does not fit int64, so is past any vocabulary: the caller then names it).
    One numpy conversion per part: the bounds check and the chunk ids read the array. ``names``: each
    chunk's name in errors (default ``chunk i``)."""
    parts, arrays = [], []
    for i, p in enumerate((*chunks, suffix)):
        where = "suffix" if i == len(chunks) else names[i] if names is not None else f"chunk {i}"
        ids, arr = part_ids(p, where)
        parts.append(ids)
        if arr is None:
            arrays = None
        elif arrays is not None:
            arrays.append(arr)
    flat = np.concatenate(arrays) if arrays else None
    return parts[:-1], parts[-1], flat


@dataclass(frozen=True, slots=True)
class CheckedRequest:
    """A request whose token ids ``Engine.check`` read: its parts as lists of ints, each chunk's id, and the
    mode, extra tokens and model it was checked for. The prefill calls take it in place of
    (chunks, suffix); made by ``Engine.check`` only (the ids are trusted: they key the chunk cache). A part
    given as a list of ints is that very list, not a copy: it must not change while the request is in use."""

    chunks: list[list[int]]
    suffix: list[int]
    chunk_ids: list[str] | None  # None when checked without them
    mode: str
    extra_tokens: int
    fingerprint: str
    namespaces: tuple[str, ...] = ()   # each chunk's namespace (chunk_cache.scoped_id), () when all are plain


class _Ids:
    """A chunk's ids as a dict key whose hash is computed once (a tuple's is not cached, and a lookup
    would hash all its ids again); equal only to equal ids."""

    __slots__ = ("ids", "h")

    def __init__(self, ids: tuple):
        self.ids, self.h = ids, hash(ids)

    def __hash__(self) -> int:
        return self.h

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, _Ids) and self.h == other.h and self.ids == other.ids)


class KnownChunks:
    """Chunk token lists already checked against one engine's vocabulary, by content -> chunk id; least
    recently used dropped past ``max_tokens`` tokens (0: nothing kept).

    The key is the ids themselves, so a hit is an equal list of ids, whatever object carries it. Python
    counts 2.0 and True equal to 2 and 1: a hit also needs the ids' sum to be a plain int, which it is
    only when every id is an int (a bool is one, and is taken as such on the long path too); anything
    else is read the long way, where a float is refused by name. Safe across threads."""

    def __init__(self, max_tokens: int = KNOWN_CHUNK_TOKENS):
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self.tokens = 0
        self.hits = self.misses = 0
        self._ids: OrderedDict[_Ids, tuple[_Ids, str]] = OrderedDict()
        self._lock = threading.Lock()

    def key(self, part) -> _Ids | None:
        """The memo key of a chunk given as a list, tuple or other sequence of ids (a protobuf repeated
        field); None for arrays, tensors and iterators, which always take the long way."""
        if not self.max_tokens:
            return None
        if type(part) is tuple or type(part) is list or (isinstance(part, SequenceABC)
                                                         and not isinstance(part, (str, bytes))):
            return _Ids(tuple(part))
        return None

    def lookup(self, parts: list) -> tuple[list[_Ids | None], list[str | None]]:
        """Each part's key and chunk id (None where not known), in one pass over the request."""
        keys = [self.key(part) for part in parts]
        with self._lock:
            cids = [self._hit(key) for key in keys]
        hits = sum(c is not None for c in cids)
        self.hits += hits
        self.misses += len(parts) - hits
        return keys, cids

    def get(self, key: _Ids | None) -> str | None:
        """One key's chunk id (None where not known)."""
        with self._lock:
            cid = self._hit(key)
        if cid is None:
            self.misses += 1
        else:
            self.hits += 1
        return cid

    def _hit(self, key: _Ids | None) -> str | None:
        """Under the lock: the id kept for key, now the most recently used; None when there is none, and for
        ids that are not all ints (the class docstring says why)."""
        if key is None:
            return None
        hit = self._ids.get(key)
        if hit is None:
            return None
        self._ids.move_to_end(hit[0])  # the stored key: found by identity, its ids not compared again
        return hit[1] if type(sum(key.ids)) is int else None

    def put(self, key: _Ids | None, cid: str) -> None:
        if key is None or not 0 < len(key.ids) <= self.max_tokens:
            return
        with self._lock:
            if key in self._ids:
                return
            self._ids[key] = (key, cid)
            self.tokens += len(key.ids)
            while self.tokens > self.max_tokens:
                old, _ = self._ids.popitem(last=False)
                self.tokens -= len(old.ids)

    def __len__(self) -> int:
        return len(self._ids)
