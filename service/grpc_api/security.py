"""The gRPC door's side of the token policy (service/security.py): an interceptor that refuses a call before its
handler runs."""
from __future__ import annotations

import grpc
import grpc.aio

from service.security import API_PREFIX, BearerAuth, SecurityConfig


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Runs first: a refused call never reaches a handler (nor learns whether the server is warming up)."""

    def __init__(self, config: SecurityConfig):
        self._auth = BearerAuth(config)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(API_PREFIX):
            return handler
        refusal = self._auth.check(method, handler_call_details.invocation_metadata)
        return handler if refusal is None else _refusing(handler, *refusal)


def _refusing(handler, code: grpc.StatusCode, message: str):
    async def refuse_unary(request, context):
        await context.abort(code, message)

    if handler.unary_unary is not None:
        return handler._replace(unary_unary=refuse_unary)
    if handler.unary_stream is not None:  # (our stream handlers are coroutines that write, as this one)
        return handler._replace(unary_stream=refuse_unary)
    return handler
