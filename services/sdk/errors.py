"""SDK exceptions: one class per gRPC status a caller may want to handle, each saying what went wrong."""

from __future__ import annotations

import grpc


class TesseraError(Exception):
    """A call to the cluster failed. ``code`` is the gRPC status name, ``details`` the server's reason."""

    def __init__(self, code: str, details: str, method: str = "") -> None:
        self.code, self.details, self.method = code, details, method
        where = f"{method}: " if method else ""
        super().__init__(f"{where}{code}: {details}")


class InvalidArgument(TesseraError):
    """The request was refused as it stands (unknown chunk id, empty request, too long, bad sampling)."""


class Unavailable(TesseraError):
    """The cluster (or every worker able to serve) could not be reached; retried calls gave up."""


class DeadlineExceeded(TesseraError):
    """The call's deadline passed before it finished."""


class Unauthenticated(TesseraError):
    """The gateway wants a bearer token (``Client(token=...)``) and got none or a wrong one."""


class ResourceExhausted(TesseraError):
    """A worker has no KV memory left for this request, or it is past one of the tenant's quotas (named)."""


class PermissionDenied(TesseraError):
    """The caller's tenant may not do this (a namespace it may not read)."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}


def from_rpc_error(exc: grpc.RpcError, method: str = "") -> TesseraError:
    code = exc.code()
    details = exc.details() or "(no details)"
    if code == grpc.StatusCode.UNAVAILABLE and "failed to connect" in details.lower():
        details = f"cannot reach the gateway ({details})"
    return _BY_CODE.get(code, TesseraError)(code.name, details, method)
