"""The decode worker's retrieval-index service as its engine's index set (``Forward.indexes``).

With the cluster's index role on (``ClusterConfig.index_threads``), each decode worker is handed the address of the
index service on its node (``tessera-index-<i>``): its retrieval sequences' offloaded K/V and their indexes live
there, not in the worker's memory. ``RemoteIndexes`` makes the calls the engine makes of an in-process ``IndexSet``
(services/engine/decode/retrieval.py: hold, add, attend, drop) over an ``IndexClient``, each with a deadline. With
``hold`` the engine decodes a retrieval sequence while the service builds its indexes (``decode_while_building``):
each layer's keys and values go to the service as soon as they are copied, are scanned whole until indexed, and the
build's ``add`` sends only the training queries and lists.

Owners are named in the service with a prefix of this worker process's own (``<prefix>:<owner>``): a restarted
worker numbers its sequences from 0 again, and what an earlier process left in the service (its sequences were never
dropped) must not refuse the new ones' offloads (ALREADY_EXISTS). What it left stays until the service restarts.

Invariant: no failure of the service stops the worker or hangs it. A call the service fails (unreachable, past its
deadline, or it lost what it held in a restart) raises ``IndexUnavailable``, whose text names no address and no
internals, so the batcher fails the requests concerned with it and goes on serving; other decode policies never call
the service. A drop that fails is logged and left: what the service holds for that sequence stays until it restarts.
"""

from __future__ import annotations

import logging
import uuid

import grpc
import numpy as np

log = logging.getLogger(__name__)


class IndexUnavailable(RuntimeError):
    """The decode worker's retrieval index service failed a call; the text is safe to show the request's caller."""


class RemoteIndexes:
    """``client``: an ``IndexClient`` of the worker's index service (its deadlines are the worker's
    ``DecodeSettings.index_*_timeout_s``); ``prefix``: this process's owner prefix (default: a new random one)."""

    def __init__(self, client, prefix: str | None = None) -> None:
        self.client = client
        self.prefix = prefix or uuid.uuid4().hex[:12]

    @property
    def host_dtype(self) -> str:
        """What the engine hands ``add`` (the client's wire dtype)."""
        return self.client.host_dtype

    def _owner(self, owner: str) -> str:
        return f"{self.prefix}:{owner}"

    def _failed(self, what: str, exc: grpc.RpcError) -> IndexUnavailable:
        code = exc.code() if isinstance(exc, grpc.Call) else None
        name = code.name if code is not None else "no status"
        log.warning("the retrieval index service at %s failed to %s: %s: %s", self.client.address, what, name,
                    exc.details() if isinstance(exc, grpc.Call) else exc)
        lost = (" (it no longer holds the sequence's keys: was it restarted?)" if code == grpc.StatusCode.NOT_FOUND
                else "")
        return IndexUnavailable(f"the decode worker's retrieval index service failed to {what}: {name}{lost}; "
                                "decode='retrieval' cannot go on for this request on this worker")

    def hold(self, owner: str, layer: int, keys, values) -> None:
        """A copied layer's keys and values, sent at once and scanned by the service's searches until ``add`` indexes
        them there (so the sequence decodes while its indexes build; ``add`` then sends no keys again). A layer with
        no key is left to ``add``."""
        if np.shape(keys)[1] == 0:
            return
        try:
            self.client.hold(self._owner(owner), layer, keys, values)
        except grpc.RpcError as exc:
            raise self._failed(f"hold layer {layer} of the sequence's keys", exc) from None

    def add(self, owner: str, layer: int, keys, values, train_queries, chunks=(), lists=None) -> int:
        try:
            return self.client.add(self._owner(owner), layer, keys, values, train_queries, chunks, lists)
        except grpc.RpcError as exc:
            raise self._failed(f"take layer {layer} of the sequence's keys", exc) from None

    def attend(self, layer: int, owners: list[str], queries, k: int, scale: float, beam: int | None = None):
        try:
            return self.client.attend(layer, [self._owner(o) for o in owners], queries, k, scale, beam)
        except grpc.RpcError as exc:
            raise self._failed(f"search layer {layer}", exc) from None

    def drop(self, owner: str) -> int:
        try:
            return self.client.drop(self._owner(owner))
        except grpc.RpcError as exc:
            self._failed(f"drop {owner}", exc)
            return 0

    def held(self) -> tuple[int, int, int]:
        """(owners, K/V bytes, index bytes) the service holds, an earlier worker process's left-overs included."""
        try:
            return self.client.held()
        except grpc.RpcError as exc:
            raise self._failed("report what it holds", exc) from None

    def nbytes(self) -> int:
        return self.held()[1]

    def close(self) -> None:
        self.client.close()
