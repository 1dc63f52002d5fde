"""Tracing of the HTTP door: a SERVER span per OpenAI request, child of the caller's W3C `traceparent` header,
under which the observer opens the same request span as for a gRPC Generate call (joined to the same engine
step spans). The request is recorded as the GenerateParams it became, so the span carries the same attributes.

  POST /v1/completions          SERVER; http.* attributes, the gRPC status of the outcome
  └ text_completion {adapter}   (observer.py)
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from service.telemetry.interceptor import CallSpan, enter_call, set_error
from service.telemetry.setup import Telemetry, never_raise

if TYPE_CHECKING:
    from service.telemetry.observer import TelemetryObserver

_PROPAGATOR = TraceContextTextMapPropagator()
GENERATE = "Generate"  # the observer opens request spans for calls of this name


class HttpTracer:
    def __init__(self, telemetry: Telemetry, observer: TelemetryObserver | None):
        self._tracer = telemetry.tracer
        self._observer = observer

    @never_raise
    def start(self, route: str, headers: dict[str, str]) -> CallSpan:
        """Open the SERVER span and make it the current call (each HTTP request runs in its own context)."""
        start_ns = time.time_ns()
        span = self._tracer.start_span(
            f"POST {route}", context=_PROPAGATOR.extract(headers), kind=SpanKind.SERVER, start_time=start_ns,
            attributes={"http.request.method": "POST", "http.route": route, "url.path": route})
        call = CallSpan(span, GENERATE, start_ns)
        enter_call(call)
        return call

    @staticmethod
    def record_request(call: CallSpan | None, request: Any) -> None:
        if call is not None:
            call.request = request  # the GenerateParams: the request span's sampling attributes

    @never_raise
    def end(self, call: CallSpan | None, code: grpc.StatusCode, http_status: int, *, cancelled: bool = False,
            message: str | None = None) -> None:
        if call is None or call.end_ns is not None:
            return
        call.end_ns, call.code, call.cancelled, call.message = time.time_ns(), code, cancelled, message
        if self._observer is not None and call.request is not None:
            self._observer.on_call_end(call)  # the request span ends with the call
        span = call.span
        span.set_attribute("http.response.status_code", http_status)
        if cancelled:
            span.add_event("cancelled", {"lora_serve.cancel.source": "client"}, timestamp=call.end_ns)
        elif code is not grpc.StatusCode.OK:
            set_error(span, code, message)
        span.end(end_time=call.end_ns)
