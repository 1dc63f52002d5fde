"""Tracing of gRPC calls: a SERVER span per loraserve.v1 call, child of the caller's W3C `traceparent`.

  loraserve.v1.Generation/Generate   SERVER; rpc.* attributes, rpc.grpc.status_code; ERROR + error.type on failure

`TracingInterceptor` goes first (outermost): its span also covers refusals by the other interceptors, and it
sees the status they set. Its `inner` companion goes last, around the handler itself, and records the request
of each call that reached it. The call in progress is `current_call()`; the request span under it belongs to
the telemetry observer, which captures it when the runner adds the request and, when the call ends
(`on_call_end`), ends the request span with the call's status.
"""
from __future__ import annotations

import asyncio
import contextvars
import time
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from service.security import API_PREFIX
from service.telemetry.setup import Telemetry, never_raise

if TYPE_CHECKING:
    from service.telemetry.observer import TelemetryObserver

_PROPAGATOR = TraceContextTextMapPropagator()
_CALL: contextvars.ContextVar[CallSpan | None] = contextvars.ContextVar("lora_serve_call", default=None)
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class CallSpan:
    """One call: its SERVER span, what the handler was given, and how the call ended."""

    __slots__ = ("span", "method", "start_ns", "request", "end_ns", "code", "message", "cancelled", "deadline_s")

    def __init__(self, span: Span, method: str, start_ns: int):
        self.span = span
        self.method = method          # e.g. "Generate"
        self.start_ns = start_ns
        self.request: Any = None      # the request message, once the call reached its handler
        self.end_ns: int | None = None
        self.code: grpc.StatusCode | None = None
        self.message: str | None = None
        self.cancelled = False        # the client cancelled (not a deadline)
        self.deadline_s: float | None = None  # the call's time limit as it reached us (None: none)


def current_call() -> CallSpan | None:
    """The traced call this code runs in (each call runs in its own contextvars.Context), if any."""
    return _CALL.get()


def enter_call(call: CallSpan) -> None:
    """Make `call` the current call of this context (the HTTP door's requests: http_tracing.py)."""
    _CALL.set(call)


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """Put first in the interceptor list, and `inner` last."""

    def __init__(self, telemetry: Telemetry, observer: TelemetryObserver | None = None):
        self._tracer = telemetry.tracer
        self._observer = observer
        self.inner = _HandlerInterceptor()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(API_PREFIX):
            return handler  # health checks and reflection: not worth a trace each
        service, _, name = method[1:].rpartition("/")
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._wrap_unary(handler.unary_unary, service, name))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._wrap_stream(handler.unary_stream, service, name))
        return handler  # the API has no client-streaming methods

    @never_raise
    def _start(self, service: str, name: str, context: grpc.aio.ServicerContext) -> CallSpan:
        carrier = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        start_ns = time.time_ns()
        span = self._tracer.start_span(
            f"{service}/{name}", context=_PROPAGATOR.extract(carrier), kind=SpanKind.SERVER, start_time=start_ns,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name})
        call = CallSpan(span, name, start_ns)
        call.deadline_s = context.time_remaining()
        _CALL.set(call)
        return call

    @never_raise
    def _end_with(self, call: CallSpan, exc: BaseException, context: grpc.aio.ServicerContext) -> None:
        if isinstance(exc, grpc.aio.AbortError):  # the error interceptor already sent the status
            self._end(call, _status_code(context.code()), message=_details(context))
        elif isinstance(exc, (asyncio.CancelledError, GeneratorExit)):  # the call went away under us
            if _deadline_passed(context, call):
                self._end(call, grpc.StatusCode.DEADLINE_EXCEEDED, message="deadline exceeded")
            else:
                self._end(call, grpc.StatusCode.CANCELLED, cancelled=True)
        else:
            self._end(call, grpc.StatusCode.UNKNOWN, message=f"{type(exc).__name__}: {exc}")

    @never_raise
    def _end(self, call: CallSpan, code: grpc.StatusCode, *, cancelled: bool = False,
             message: str | None = None) -> None:
        call.end_ns, call.code, call.cancelled, call.message = time.time_ns(), code, cancelled, message
        if self._observer is not None and call.request is not None:
            self._observer.on_call_end(call)  # the request span ends with the call
        span = call.span
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if cancelled:
            span.add_event("cancelled", {"lora_serve.cancel.source": "client"}, timestamp=call.end_ns)
        elif code is not grpc.StatusCode.OK:
            set_error(span, code, message)
        span.end(end_time=call.end_ns)

    def _wrap_unary(self, behavior, service: str, name: str):
        async def wrapper(request, context):
            call = self._start(service, name, context)
            try:
                response = await behavior(request, context)
            except BaseException as exc:
                if call is not None:
                    self._end_with(call, exc, context)
                raise
            if call is not None:
                self._end(call, grpc.StatusCode.OK)
            return response
        return wrapper

    def _wrap_stream(self, behavior, service: str, name: str):
        async def wrapper(request, context):  # our stream handlers send with context.write()
            call = self._start(service, name, context)
            try:
                await behavior(request, context)
            except BaseException as exc:  # also CancelledError: the stream was closed under us
                if call is not None:
                    self._end_with(call, exc, context)
                raise
            if call is not None:
                self._end(call, grpc.StatusCode.OK)
        return wrapper


class _HandlerInterceptor(grpc.aio.ServerInterceptor):
    """Last in the list: marks the calls that reached their handler (a call refused by authentication, while
    warming up, or as bytes that do not parse gets no request span)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(API_PREFIX):
            return handler
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_marking(handler.unary_unary))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=_marking(handler.unary_stream))
        return handler


def _marking(behavior):
    async def wrapper(request, context):  # a coroutine for unary and (context.write) stream handlers alike
        call = _CALL.get()
        if call is not None:
            call.request = request
        return await behavior(request, context)
    return wrapper


def set_error(span: Span, code: grpc.StatusCode, message: str | None) -> None:
    span.set_status(Status(StatusCode.ERROR, message or code.name))
    span.set_attribute("error.type", code.name)


def _status_code(value: Any) -> grpc.StatusCode:
    if isinstance(value, grpc.StatusCode):
        return value
    if isinstance(value, int):
        return _CODES.get(value, grpc.StatusCode.UNKNOWN)
    return grpc.StatusCode.UNKNOWN


def _details(context: grpc.aio.ServicerContext) -> str | None:
    details = context.details()
    if isinstance(details, bytes):
        details = details.decode("utf-8", "replace")
    return details or None


def _deadline_passed(context: grpc.aio.ServicerContext, call: CallSpan) -> bool:
    """Whether a call that went away ended at its deadline. The client's timer started before ours (by the time
    the call took to reach us, more on a loaded host), and at its deadline the client cancels the stream as it
    would by hand, so a cancel in the last quarter of the time the call had when it reached us is its deadline."""
    remaining = context.time_remaining()
    if remaining is None or call.deadline_s is None:
        return False
    return remaining <= max(0.005, 0.25 * call.deadline_s)
