"""Bearer-token authentication of the client API, as a server interceptor.

Only the Tessera service is guarded: health checks and reflection stay open so that load
balancers and grpcurl can see the server. A missing token, or one that names no tenant
(services/gateway/tenants.py), is UNAUTHENTICATED before any handler runs; the handler reads
the tenant from the same token.
"""

from __future__ import annotations

import grpc

from services.gateway.tenants import Tenants


class TenantAuth(grpc.aio.ServerInterceptor):
    def __init__(self, tenants: Tenants, service: str) -> None:
        self.tenants = tenants
        self._prefix = f"/{service}/"

        async def deny_unary(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
            yield  # pragma: no cover - makes this an async generator (server-streaming handler)

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny_unary)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny_stream)

    async def intercept_service(self, continuation, details):
        if not details.method.startswith(self._prefix) or self.tenants.authenticate(details.invocation_metadata):
            return await continuation(details)
        return self._deny_stream if details.method.endswith("/Generate") else self._deny_unary
