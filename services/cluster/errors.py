"""What a worker tells a caller when one request fails: whose fault it was, and nothing of its insides.

A request's failure is a ``RequestError``: the client's fault (``INVALID_ARGUMENT``), no memory for it
now (``RESOURCE_EXHAUSTED``), or ours (``INTERNAL``). Ours never carries a Python exception's text to
the caller: ``internal`` logs the exception with its traceback under a short id and the caller gets the
id, which finds the cause in the worker's log.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

import grpc

log = logging.getLogger("tessera.errors")

CODES = {"invalid": grpc.StatusCode.INVALID_ARGUMENT, "exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
         "internal": grpc.StatusCode.INTERNAL}


@dataclass(frozen=True, slots=True)
class RequestError:
    """One request's failure: ``kind`` one of ``CODES``; ``message`` is safe to show the caller."""

    kind: str
    message: str

    def __post_init__(self) -> None:
        if self.kind not in CODES:
            raise ValueError(f"unknown error kind {self.kind!r}; one of {', '.join(CODES)}")

    @property
    def code(self) -> grpc.StatusCode:
        return CODES[self.kind]


def internal(where: str, exc: BaseException) -> RequestError:
    """Log ``exc`` with its traceback under a fresh id; the error the caller sees names only the id."""
    eid = uuid.uuid4().hex[:12]
    log.error("internal error %s in %s: %s: %s", eid, where, type(exc).__name__, exc, exc_info=exc)
    return RequestError("internal", f"internal error {eid} in {where} (its cause is in that service's log "
                                    "under this id)")
