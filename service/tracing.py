"""OpenTelemetry for lora-serve: a span per gRPC call, a GenAI request span, engine step spans, GenAI metrics.

Off unless asked for (`lora-serve --tracing` or LORA_SERVE_TRACING=1). Off means no provider and no span
object anywhere: the server, scheduler and servicer each test one `telemetry is None` / `trace is None`.
On, everything is configured by the standard OTEL_* variables:

  OTEL_SERVICE_NAME (default lora-serve), OTEL_RESOURCE_ATTRIBUTES, OTEL_SDK_DISABLED,
  OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_PROTOCOL = grpc (default, as the Python distro) | http/protobuf,
  and per signal OTEL_EXPORTER_OTLP_{TRACES,METRICS}_{ENDPOINT,PROTOCOL,TIMEOUT,HEADERS,...},
  OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG, OTEL_{TRACES,METRICS}_EXPORTER = otlp | console | none,
  OTEL_BSP_* (span queue and batching), OTEL_METRIC_EXPORT_INTERVAL.

Spans of one Generate call:
  loraserve.v1.Generation/Generate        SERVER; child of the caller's W3C traceparent when it sent one
  └ text_completion {adapter|base model}  GenAI attributes; events first_token, cancelled
    ├ queue                               add_request → admission
    ├ adapter.load                        admission had to copy the adapter into a device slot
    └ prefill                             admission → first token
and per engine step (a trace of its own, linked to the request spans of the sequences it ran):
  engine.step → lora.batch_init, model.forward, sample
The engine thread only takes timestamps; spans are built on the event loop with explicit start and end times.
Spans are exported by a BatchSpanProcessor (bounded queue, its own thread), so a slow or dead collector costs
dropped spans, never a failed or slower request.
"""
from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import grpc.aio
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .interceptors import API_PREFIX

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider

    from lora_compile import Engine
    from lora_compile.engine import StepOutput

    from .request import GenerationRequest, RequestOutput
    from .scheduler import EngineRunner, RequestState

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])

TRACING_ENV = "LORA_SERVE_TRACING"
DEFAULT_SERVICE_NAME = "lora-serve"
EXPORT_TIMEOUT_S = 5.0   # per export, unless OTEL_EXPORTER_OTLP_*TIMEOUT says otherwise (the OTLP default is 10)
SHUTDOWN_TIMEOUT_S = 5.0  # the last flush at exit; a dead collector must not hold the process
MAX_MODEL_LABELS = 64    # distinct gen_ai.request.model values on metrics; later ones are "other"
OTHER_MODEL = "other"
OPERATION = "text_completion"

# Histogram buckets: the GenAI semantic conventions' advice, and ours for step phases (0.1 ms .. 1 s).
_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
_STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

_PROPAGATOR = TraceContextTextMapPropagator()
_ROOT = Context()  # engine steps start their own traces, whatever the current context
_CALL: contextvars.ContextVar[CallTrace | None] = contextvars.ContextVar("lora_serve_call", default=None)
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _never_raise(fn: F) -> F:
    """Tracing must never fail a request: log a hook's first failure, then carry on without it."""
    failed = False

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal failed
        try:
            return fn(*args, **kwargs)
        except Exception:  # noqa: BLE001
            if not failed:
                failed = True
                log.warning("tracing hook %s failed; requests go on", fn.__qualname__, exc_info=True)
            return None
    return wrapper  # type: ignore[return-value]


# --- set-up from the environment ------------------------------------------------------------------------
def tracing_requested(flag: bool = False) -> bool:
    """`--tracing`, or LORA_SERVE_TRACING=1/true/yes/on."""
    return flag or os.environ.get(TRACING_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def setup_telemetry() -> Telemetry | None:
    """Tracer and meter providers from the OTEL_* environment; None when OTEL_SDK_DISABLED=true.
    Raises ValueError for an exporter or protocol we do not know (a typo should not silently drop data)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    resource = Resource.create({} if named else {"service.name": DEFAULT_SERVICE_NAME})
    # The sampler comes from OTEL_TRACES_SAMPLER (default parentbased_always_on). We shut down ourselves.
    tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    span_exporter = _exporter("traces")
    if span_exporter is not None:
        tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
    metric_exporter = _exporter("metrics")
    readers = [PeriodicExportingMetricReader(metric_exporter)] if metric_exporter is not None else []
    meter_provider = MeterProvider(resource=resource, metric_readers=readers, shutdown_on_exit=False)
    return Telemetry(tracer_provider, meter_provider)


def describe_export() -> str:
    """One line for the start-up log: where spans and metrics go."""
    parts = []
    for signal in ("traces", "metrics"):
        kind = _exporter_kind(signal)
        if kind == "otlp":
            endpoint = (os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT")
                        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "the default endpoint")
            kind = f"OTLP {_protocol(signal)} to {endpoint}"
        parts.append(f"{signal}: {kind}")
    return "; ".join(parts)


def _exporter_kind(signal: str) -> str:
    return (os.environ.get(f"OTEL_{signal.upper()}_EXPORTER") or "otlp").strip().lower()


def _protocol(signal: str) -> str:
    """Per-signal protocol, else the general one, else grpc."""
    return (os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL")
            or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip().lower()


def _exporter(signal: str):
    kind = _exporter_kind(signal)
    if kind == "none":
        return None
    if kind == "console":
        if signal == "traces":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter
            return ConsoleSpanExporter()
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter
        return ConsoleMetricExporter()
    if kind != "otlp":
        raise ValueError(f"OTEL_{signal.upper()}_EXPORTER={kind!r}: lora-serve knows otlp, console and none")
    protocol = _protocol(signal)
    timed = os.environ.get("OTEL_EXPORTER_OTLP_TIMEOUT") or os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_TIMEOUT")
    timeout = None if timed else EXPORT_TIMEOUT_S  # None: the exporter reads the variables itself
    if protocol == "grpc":
        if signal == "traces":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            return OTLPSpanExporter(timeout=timeout)
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        return OTLPMetricExporter(timeout=timeout)
    if protocol == "http/protobuf":
        if signal == "traces":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
            return HttpSpanExporter(timeout=timeout)
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetricExporter
        return HttpMetricExporter(timeout=timeout)
    raise ValueError(f"OTLP protocol {protocol!r} for {signal}: use grpc or http/protobuf")


# --- the providers and instruments of one server --------------------------------------------------------
class Telemetry:
    """Tracer, meter and instruments. Wherever it is passed as None, tracing is off."""

    def __init__(self, tracer_provider: TracerProvider, meter_provider: MeterProvider,
                 max_model_labels: int = MAX_MODEL_LABELS):
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self.tracer = tracer_provider.get_tracer("lora_serve")
        meter = meter_provider.get_meter("lora_serve")
        self.ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token", "s", "Time from the request's arrival to its first token",
            explicit_bucket_boundaries_advisory=_TTFT_BUCKETS)
        self.tpot = meter.create_histogram(
            "gen_ai.server.time_per_output_token", "s", "Time per output token after the first",
            explicit_bucket_boundaries_advisory=_TPOT_BUCKETS)
        self.duration = meter.create_histogram(
            "gen_ai.server.request.duration", "s", "Generate duration, from arrival to the last token or error",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS)
        # Semconv defines token usage as a client metric only; the server reports the same histogram.
        self.token_usage = meter.create_histogram(
            "gen_ai.client.token.usage", "{token}", "Input and output tokens per request",
            explicit_bucket_boundaries_advisory=_TOKEN_BUCKETS)
        self.batch_init = meter.create_histogram(
            "lora_serve.step.batch_init.duration", "s", "Engine step: batch init (LoRA and attention metadata)",
            explicit_bucket_boundaries_advisory=_STEP_BUCKETS)
        self.forward = meter.create_histogram(
            "lora_serve.step.forward.duration", "s", "Engine step: the model's forward",
            explicit_bucket_boundaries_advisory=_STEP_BUCKETS)
        self._labels: dict[str, str] = {}
        self._max_labels = max_model_labels

    def model_label(self, model: str) -> str:
        """The model or adapter name as a metric attribute; "other" once the label budget is spent."""
        label = self._labels.get(model)
        if label is None:
            if len(self._labels) >= self._max_labels:
                return OTHER_MODEL
            label = self._labels[model] = model
        return label

    # --- engine steps (on the event loop, after the step returned) ---------------------------------------
    @_never_raise
    def on_iteration(self, admitted: Iterable[RequestState], stepped: Sequence[RequestState],
                     step: StepOutput | None) -> None:
        """After one scheduler iteration: admission spans, first tokens, the step span and its metrics."""
        for state in admitted:
            if state.trace is not None:
                state.trace.emit_admission()
        if step is None:  # the step failed (its requests end with INTERNAL) or nothing ran
            return
        end_ns = step_end_ns(step)
        traces = []
        for state in stepped:
            rt = state.trace
            if rt is not None:
                traces.append(rt)
                if rt.first_token_ns is None and state.seq.output_ids:
                    rt.first_token(end_ns)
        self.record_step(step, len(stepped), traces)

    def record_step(self, step: StepOutput, batch_size: int, requests: Iterable[RequestTrace] = ()) -> None:
        kind = {"lora_serve.step.kind": step.kind}
        self.batch_init.record(step.batch_init_s, kind)
        self.forward.record(step.forward_s, kind)
        t0 = step.start_ns
        t1 = t0 + int(step.batch_init_s * 1e9)
        t1m = t1 + int(step.merge_s * 1e9)
        t2 = t1m + int(step.forward_s * 1e9)
        t3 = t2 + int(step.sample_s * 1e9)
        links = [Link(rt.span.get_span_context()) for rt in requests if rt.span.is_recording()]
        span = self.tracer.start_span("engine.step", context=_ROOT, links=links, start_time=t0, attributes={
            "lora_serve.step.kind": step.kind,
            "lora_serve.step.batch_size": batch_size,
            "lora_serve.step.num_tokens": step.num_tokens,
            "lora_serve.step.num_adapters": step.num_adapters,
            "lora_serve.step.num_sampled": len(step.seq_ids),
            "lora_serve.step.lora_merged": step.merged,
        })
        if span.is_recording():
            ctx = trace.set_span_in_context(span)
            children = [("lora.batch_init", t0, t1), ("model.forward", t1m, t2), ("sample", t2, t3)]
            if step.merge_s:  # this step merged its lone adapter into the weights first (lora_merge)
                children.insert(1, ("lora.merge", t1, t1m))
            for name, start, end in children:
                self.tracer.start_span(name, context=ctx, start_time=start).end(end_time=end)
        span.end(end_time=t3)

    # --- lifecycle -------------------------------------------------------------------------------------
    def force_flush(self, timeout_millis: int = 10_000) -> bool:
        """Export everything recorded so far (blocking); for tests and benchmarks."""
        spans = self.tracer_provider.force_flush(timeout_millis)
        metrics = self.meter_provider.force_flush(timeout_millis)
        return bool(spans and metrics)

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Flush and stop the exporters, waiting at most `timeout_s`."""
        def stop() -> None:
            self.tracer_provider.shutdown()
            self.meter_provider.shutdown(timeout_millis=timeout_s * 1000)

        # The SDK's shutdown may wait on a dead collector for the whole export timeout per batch: bound it.
        thread = threading.Thread(target=stop, name="otel-shutdown", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            log.warning("telemetry not flushed within %.0fs (collector unreachable?); exiting anyway", timeout_s)


def step_end_ns(step: StepOutput) -> int:
    return step.start_ns + int((step.batch_init_s + step.merge_s + step.forward_s + step.sample_s) * 1e9)


# --- one gRPC call ---------------------------------------------------------------------------------------
class CallTrace:
    """The SERVER span of one call, and the request span the servicer may hang under it."""

    __slots__ = ("telemetry", "span", "request")

    def __init__(self, telemetry: Telemetry, span: Span):
        self.telemetry = telemetry
        self.span = span
        self.request: RequestTrace | None = None

    @_never_raise
    def end_with(self, exc: BaseException, context: grpc.aio.ServicerContext) -> None:
        if isinstance(exc, grpc.aio.AbortError):  # the error interceptor already sent the status
            self.end(_status_code(context.code()), message=_details(context))
        elif isinstance(exc, (asyncio.CancelledError, GeneratorExit)):  # the call went away under us
            if _deadline_passed(context):
                self.end(grpc.StatusCode.DEADLINE_EXCEEDED, message="deadline exceeded")
            else:
                self.end(grpc.StatusCode.CANCELLED, cancelled=True)
        else:
            self.end(grpc.StatusCode.UNKNOWN, message=f"{type(exc).__name__}: {exc}")

    @_never_raise
    def end(self, code: grpc.StatusCode, *, cancelled: bool = False, message: str | None = None) -> None:
        now = time.time_ns()
        if self.request is not None:
            self.request.end(code, cancelled, now, message)
        span = self.span
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if cancelled:
            span.add_event("cancelled", {"lora_serve.cancel.source": "client"}, timestamp=now)
        elif code is not grpc.StatusCode.OK:
            _set_error(span, code, message)
        span.end(end_time=now)


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """Put first in the interceptor list (outermost): a SERVER span per loraserve.v1 call, child of the
    caller's `traceparent`; it sees the final status the error interceptor set."""

    def __init__(self, telemetry: Telemetry):
        self._telemetry = telemetry

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

    @_never_raise
    def _start(self, service: str, name: str, context: grpc.aio.ServicerContext) -> CallTrace:
        carrier = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        span = self._telemetry.tracer.start_span(
            f"{service}/{name}", context=_PROPAGATOR.extract(carrier), kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name})
        call = CallTrace(self._telemetry, span)
        _CALL.set(call)  # each call runs in its own contextvars.Context; the servicer finds it here
        return call

    def _wrap_unary(self, behavior, service: str, name: str):
        async def wrapper(request, context):
            call = self._start(service, name, context)
            try:
                response = await behavior(request, context)
            except BaseException as exc:
                if call is not None:
                    call.end_with(exc, context)
                raise
            if call is not None:
                call.end(grpc.StatusCode.OK)
            return response
        return wrapper

    def _wrap_stream(self, behavior, service: str, name: str):
        async def wrapper(request, context):  # our stream handlers send with context.write()
            call = self._start(service, name, context)
            try:
                await behavior(request, context)
            except BaseException as exc:  # also CancelledError: the stream was closed under us
                if call is not None:
                    call.end_with(exc, context)
                raise
            if call is not None:
                call.end(grpc.StatusCode.OK)
        return wrapper


# --- one Generate request ----------------------------------------------------------------------------
@_never_raise
def start_request(request: Any, runner: EngineRunner) -> RequestTrace | None:
    """The servicer's hook: the request span under the current call's server span (None outside a call)."""
    call = _CALL.get()
    if call is None:
        return None
    adapter = request.adapter
    known = not adapter or runner.has_adapter(adapter)  # unknown names stay out of span names and metrics
    call.request = RequestTrace(call.telemetry, call.span, adapter or runner.model_info().model, known, request)
    return call.request


class RequestTrace:
    """The request span of one Generate call and the scheduler's timestamps for it (wall clock ns).

    Who calls what: the servicer creates it and reports the last output (finished); the scheduler reports
    queueing (queued), admission (admitted, from the engine thread: plain assignments) and the first token;
    the interceptor ends it with the call's status (end)."""

    __slots__ = ("_tel", "span", "_ctx", "model", "_attrs", "start_ns", "queued_ns", "admit_start_ns",
                 "admit_end_ns", "adapter_loaded", "_admission_emitted", "first_token_ns", "_ended")

    def __init__(self, telemetry: Telemetry, parent: Span, model: str, known: bool, request: Any):
        self._tel = telemetry
        self.model = model
        self.start_ns = time.time_ns()
        attributes = {"gen_ai.operation.name": OPERATION, "gen_ai.request.model": model[:256],
                      **_request_attributes(request)}
        self.span = telemetry.tracer.start_span(f"{OPERATION} {model}" if known else OPERATION,
                                                context=trace.set_span_in_context(parent),
                                                start_time=self.start_ns, attributes=attributes)
        self._ctx = trace.set_span_in_context(self.span)
        self._attrs = {"gen_ai.operation.name": OPERATION,
                       "gen_ai.request.model": telemetry.model_label(model) if known else OTHER_MODEL}
        self.queued_ns: int | None = None
        self.admit_start_ns: int | None = None
        self.admit_end_ns: int | None = None
        self.adapter_loaded = False
        self._admission_emitted = False
        self.first_token_ns: int | None = None
        self._ended = False  # the step span work is deferred: it may come after the call ended

    @_never_raise
    def queued(self, request: GenerationRequest) -> None:
        self.queued_ns = time.time_ns()
        self.span.set_attributes({"gen_ai.usage.input_tokens": len(request.prompt_ids),
                                  "lora_serve.request.id": request.request_id})

    def admitted(self, start_ns: int, end_ns: int, adapter_loaded: bool) -> None:
        """Engine thread: timestamps only; emit_admission makes the spans on the event loop."""
        self.admit_start_ns, self.admit_end_ns, self.adapter_loaded = start_ns, end_ns, adapter_loaded

    @_never_raise
    def emit_admission(self) -> None:
        if self._admission_emitted or self._ended or self.admit_start_ns is None:
            return
        self._admission_emitted = True
        self._child("queue", self.queued_ns or self.admit_start_ns, self.admit_start_ns)
        if self.adapter_loaded:
            self._child("adapter.load", self.admit_start_ns, self.admit_end_ns,
                        {"lora_serve.adapter.name": self.model})

    @_never_raise
    def first_token(self, at_ns: int) -> None:
        self.first_token_ns = at_ns
        if self._ended:
            return
        ttft = (at_ns - self.start_ns) / 1e9
        self._child("prefill", self.admit_end_ns or at_ns, at_ns)
        self.span.add_event("first_token", timestamp=at_ns)
        self.span.set_attribute("gen_ai.server.time_to_first_token", ttft)
        self._tel.ttft.record(ttft, self._attrs)

    @_never_raise
    def finished(self, out: RequestOutput) -> None:
        """The last output: usage and finish reason (the span ends with the call)."""
        now = time.time_ns()
        self.span.set_attributes({"gen_ai.usage.input_tokens": out.prompt_tokens,
                                  "gen_ai.usage.output_tokens": out.completion_tokens,
                                  "gen_ai.response.finish_reasons": [out.finish_reason or ""]})
        tel = self._tel
        tel.token_usage.record(out.prompt_tokens, {**self._attrs, "gen_ai.token.type": "input"})
        tel.token_usage.record(out.completion_tokens, {**self._attrs, "gen_ai.token.type": "output"})
        if self.first_token_ns is not None and out.completion_tokens > 1:
            tel.tpot.record((now - self.first_token_ns) / 1e9 / (out.completion_tokens - 1), self._attrs)

    @_never_raise
    def end(self, code: grpc.StatusCode, cancelled: bool, now: int, message: str | None = None) -> None:
        if self.admit_start_ns is not None:
            self.emit_admission()  # admitted, but the call ended before the loop saw it
            if self.first_token_ns is None:
                self._child("prefill", self.admit_end_ns, now)
        elif self.queued_ns is not None:
            self._child("queue", self.queued_ns, now)  # never admitted
        self._ended = True
        span = self.span
        if cancelled:
            span.add_event("cancelled", {"lora_serve.cancel.source": "client"}, timestamp=now)
            span.set_attributes({"lora_serve.cancelled": True, "gen_ai.response.finish_reasons": ["cancelled"]})
        else:
            attrs = self._attrs
            if code is not grpc.StatusCode.OK:
                _set_error(span, code, message)
                attrs = {**attrs, "error.type": code.name}
            # Client-cancelled requests are left out: how long they ran was the client's choice.
            self._tel.duration.record((now - self.start_ns) / 1e9, attrs)
        span.end(end_time=now)

    def _child(self, name: str, start: int, end: int, attributes: dict[str, Any] | None = None) -> None:
        if self.span.is_recording():
            self._tel.tracer.start_span(name, context=self._ctx, start_time=start,
                                        attributes=attributes).end(end_time=end)


def adapter_on_device(engine: Engine, name: str | None) -> bool:
    """Whether admitting a request for `name` needs no adapter load (asked only while tracing)."""
    return not name or any(a.name == name and a.device_slot is not None for a in engine.adapters.list())


# --- helpers ---------------------------------------------------------------------------------------------
_SAMPLING_ATTRIBUTES = (("temperature", "gen_ai.request.temperature"), ("top_p", "gen_ai.request.top_p"),
                        ("top_k", "gen_ai.request.top_k"), ("seed", "gen_ai.request.seed"))


def _request_attributes(request: Any) -> dict[str, Any]:
    """The sampling parameters the client set (unset ones are the server's defaults, not the request's)."""
    attrs: dict[str, Any] = {}
    sampling = request.sampling
    for field, key in _SAMPLING_ATTRIBUTES:
        if sampling.HasField(field):
            value = getattr(sampling, field)
            if isinstance(value, float):
                value = round(value, 6)  # float32 on the wire: 0.8 arrives as 0.800000011920929
            elif value >= 2**63:
                value = str(value)  # a uint64 seed beyond OTLP's int64
            attrs[key] = value
    if request.stopping.HasField("max_new_tokens"):
        attrs["gen_ai.request.max_tokens"] = request.stopping.max_new_tokens
    return attrs


def _set_error(span: Span, code: grpc.StatusCode, message: str | None) -> None:
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


def _deadline_passed(context: grpc.aio.ServicerContext) -> bool:
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0.001
