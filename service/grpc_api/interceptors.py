"""The server interceptor: refuses calls while not serving, and turns every exception into a rich status.

Handlers only raise; this is the single place where exceptions become gRPC statuses (see errors.py).
"""
from __future__ import annotations

from collections.abc import Callable

import grpc
import grpc.aio

from service.errors import MalformedRequest, ServiceError, Unavailable, to_rpc_status
from service.lifecycle import ServingState
from service.security import API_PREFIX  # health and reflection stay reachable while warming up or draining


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, state: Callable[[], ServingState]):
        self._state = state

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(API_PREFIX):
            return handler
        # grpc would answer a request that does not parse with UNKNOWN; parse here and refuse it properly.
        handler = handler._replace(request_deserializer=_lenient(handler.request_deserializer))
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._wrap_unary(handler.unary_unary))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._wrap_stream(handler.unary_stream))
        return handler  # the API has no client-streaming methods

    def _refusal(self) -> ServiceError | None:
        state = self._state()
        if state is ServingState.SERVING:
            return None
        return Unavailable(f"server is {state.value}; retry later" if state is ServingState.WARMING_UP
                           else "server is draining (shutting down); retry on another replica")

    def _admit(self, request) -> None:
        """Refuse before the handler runs: not serving (warming up, draining) or bytes that did not parse."""
        if (refusal := self._refusal()) is not None:
            raise refusal
        if isinstance(request, _Unparsable):
            raise MalformedRequest(request.message_type, request.reason)

    def _wrap_unary(self, behavior):
        async def wrapper(request, context):
            try:
                self._admit(request)
                return await behavior(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - mapped to a status, the server keeps serving
                await context.abort_with_status(to_rpc_status(exc))
        return wrapper

    def _wrap_stream(self, behavior):
        async def wrapper(request, context):  # stream handlers send with context.write()
            try:
                self._admit(request)
                await behavior(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001
                await context.abort_with_status(to_rpc_status(exc))
        return wrapper


class _Unparsable:
    """Stands in for a request whose bytes did not parse; the wrapped handler refuses it."""

    def __init__(self, message_type: str, reason: str):
        self.message_type, self.reason = message_type, reason


def _lenient(deserialize):
    if deserialize is None:
        return None
    message_type = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)
    name = message_type.full_name if message_type is not None else "request"

    def parse(raw: bytes):
        try:
            return deserialize(raw)
        except Exception as exc:  # noqa: BLE001 - google.protobuf.message.DecodeError (also for invalid UTF-8)
            # "Error parsing message with type '...': String field had bad UTF-8" → the part after the type
            return _Unparsable(name, str(exc).rpartition("': ")[2] or type(exc).__name__)
    return parse
