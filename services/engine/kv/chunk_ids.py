"""Chunk ids: the content hash that names a chunk in every tier and on every worker (numpy only: the gateway
computes them too, without torch).

A chunk's content id is sha256 over the model fingerprint and its token ids as int64; in a tenant's namespace
the id is another hash of the namespace and that content id (``scoped_id``), so one tenant's chunks are never
another's.
"""

from __future__ import annotations

import hashlib

import numpy as np


def chunk_ids_of(fingerprint: str, flat: np.ndarray, lengths: list[int]) -> list[str]:
    """The content id of each of the chunks laid one after another in ``flat`` (int64), ``lengths`` [chunks]:
    the hashes read the array's slices in place."""
    ids, at = [], 0
    for n in lengths:
        h = hashlib.sha256(fingerprint.encode())
        h.update(flat[at:at + n])
        ids.append(h.hexdigest())
        at += n
    return ids


def scoped_id(namespace: str, cid: str) -> str:
    """The id of the chunk of content id ``cid`` in ``namespace``: another hash per namespace, so that one
    tenant's chunks are never another's ("": the plain content id, for a cluster without tenants)."""
    if not namespace:
        return cid
    return hashlib.sha256(f"{namespace}\0{cid}".encode()).hexdigest()


def checked_chunk_id(fingerprint: str, ids, namespace: str = "") -> str:
    """The id of a chunk given as integer token ids the caller has already checked (a list, tuple or a
    message's repeated field)."""
    return scoped_id(namespace, chunk_ids_of(fingerprint, np.asarray(ids, dtype=np.int64), [len(ids)])[0])


def index_entry_id(chunk_id: str) -> str:
    """The store id of a chunk's retrieval indexes (services/index/chunks.py), beside the chunk's own: another hash,
    so it is never a chunk's id."""
    return hashlib.sha256(f"retrieval-index\0{chunk_id}".encode()).hexdigest()
