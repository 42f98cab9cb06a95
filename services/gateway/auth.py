"""Bearer-token authentication of the client API, as a server interceptor.

Only the Tessera service is guarded: health checks and reflection stay open so that load
balancers and grpcurl can see the server. A missing or wrong token is UNAUTHENTICATED.
"""

from __future__ import annotations

import hmac

import grpc


class BearerAuth(grpc.aio.ServerInterceptor):
    def __init__(self, token: str, service: str) -> None:
        if not token:
            raise ValueError("an empty token would let everyone in")
        self._expected = f"Bearer {token}".encode()
        self._prefix = f"/{service}/"

        async def deny_unary(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
            yield  # pragma: no cover - makes this an async generator (server-streaming handler)

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny_unary)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny_stream)

    async def intercept_service(self, continuation, details):
        if not details.method.startswith(self._prefix):
            return await continuation(details)
        sent = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(sent.encode() if isinstance(sent, str) else sent, self._expected):
            return await continuation(details)
        return self._deny_stream if details.method.endswith("/Generate") else self._deny_unary
