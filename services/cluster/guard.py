"""Every service's server interceptor: who may call, and what a caller sees when a handler fails.

``RoleGuard`` wraps each RPC handler of a server:
- with the cluster's mutual TLS on, the caller's role is read from its certificate (the handshake has
  already checked the certificate against the cluster CA) and the method is refused PERMISSION_DENIED
  unless ``security.POLICY`` lets that role call it: a refused call runs nothing and changes nothing;
- an exception a handler did not turn into a status becomes INTERNAL with an error id, its traceback in
  this service's log (gRPC would send the exception's text as UNKNOWN).
"""

from __future__ import annotations

import grpc

from services.cluster.errors import internal
from services.cluster.security import allowed_roles, role_of

OPEN = ("/grpc.health.v1.Health/", "/grpc.reflection.")     # health checks and reflection


def caller_role(context) -> str | None:
    """The role named by the caller's verified certificate, None without one."""
    names = context.auth_context().get("x509_common_name") or []
    for name in names:
        role = role_of(name.decode() if isinstance(name, bytes) else name)
        if role is not None:
            return role
    return None


class RoleGuard(grpc.aio.ServerInterceptor):
    """``where``: the service's name in error messages; ``authorize``: check callers' roles (mutual TLS on)."""

    def __init__(self, where: str, authorize: bool) -> None:
        self.where = where
        self.authorize = authorize

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        if method.startswith(OPEN):
            return handler     # any holder of a cluster certificate (the handshake checked it) may call these
        roles = allowed_roles(method) if self.authorize else None
        return _wrap(handler, method, roles, self.where)


async def _admit(context, method: str, roles: frozenset[str] | None) -> None:
    if roles is None:
        return
    role = caller_role(context)
    if role is None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{method} needs a cluster certificate")
    if role not in roles:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"role {role} may not call {method}")


async def _failed(context, where: str, method: str, exc: Exception) -> None:
    err = internal(f"{where} {method}", exc)
    await context.abort(err.code, err.message)


class _Undecodable:
    """What a request's deserializer made of bytes that are not its message (grpc would answer UNKNOWN with the
    decoder's exception text; the handler answers INVALID_ARGUMENT instead)."""

    __slots__ = ()


UNDECODABLE = _Undecodable()


def _safe(deserializer):
    if deserializer is None:
        return None

    def decode(raw):
        try:
            return deserializer(raw)
        except Exception:  # noqa: BLE001 - any decoder's refusal: the caller sent no valid message
            return UNDECODABLE
    return decode


def _wrap(handler, method: str, roles: frozenset[str] | None, where: str):
    """The same handler, checked first and with its unexpected errors turned into statuses: a unary response's
    behaviour is wrapped as a coroutine, a streamed one's as an async generator. The request deserializer's
    refusal (bytes that are not the message) is INVALID_ARGUMENT, for a request message and for every message
    of a request stream."""
    refused = f"{method}: the request is not a valid message of this method"

    def requests(request, context):
        if not handler.request_streaming:
            return request

        async def checked():
            async for message in request:
                if message is UNDECODABLE:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refused)
                yield message
        return checked()

    async def admit(request, context):
        await _admit(context, method, roles)
        if request is UNDECODABLE:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refused)

    def unary(inner):
        async def behaviour(request, context):
            await admit(request, context)
            try:
                return await inner(requests(request, context), context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - a status with an id, not the exception's text
                await _failed(context, where, method, exc)
        return behaviour

    def streamed(inner):
        async def behaviour(request, context):
            await admit(request, context)
            try:
                async for message in inner(requests(request, context), context):
                    yield message
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - a status with an id, not the exception's text
                await _failed(context, where, method, exc)
        return behaviour

    safe = _safe(handler.request_deserializer)
    for kind, wrap in (("unary_unary", unary), ("stream_unary", unary), ("unary_stream", streamed),
                       ("stream_stream", streamed)):
        inner = getattr(handler, kind)
        if inner is not None:
            return handler._replace(**{kind: wrap(inner), "request_deserializer": safe})
    return handler
