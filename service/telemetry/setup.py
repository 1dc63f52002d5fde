"""OpenTelemetry set-up for lora-serve: tracer and meter providers and their exporters, from the environment.

Off unless asked for (`lora-serve --tracing` or LORA_SERVE_TRACING=1). Off means no provider, no interceptor,
no observer and no span object anywhere. On, everything is configured by the standard OTEL_* variables:

  OTEL_SERVICE_NAME (default lora-serve), OTEL_RESOURCE_ATTRIBUTES, OTEL_SDK_DISABLED,
  OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_PROTOCOL = grpc (default, as the Python distro) | http/protobuf,
  and per signal OTEL_EXPORTER_OTLP_{TRACES,METRICS}_{ENDPOINT,PROTOCOL,TIMEOUT,HEADERS,...},
  OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG, OTEL_{TRACES,METRICS}_EXPORTER = otlp | console | none,
  OTEL_BSP_* (span queue and batching), OTEL_METRIC_EXPORT_INTERVAL.

Spans are exported by a BatchSpanProcessor (bounded queue, its own thread), so a slow or dead collector costs
dropped spans, never a failed or slower request. Who makes which span: telemetry_interceptor.py (a SERVER span
per gRPC call) and telemetry_observer.py (request and engine-step spans, metrics).
"""
from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])

TRACING_ENV = "LORA_SERVE_TRACING"
DEFAULT_SERVICE_NAME = "lora-serve"
EXPORT_TIMEOUT_S = 5.0   # per export, unless OTEL_EXPORTER_OTLP_*TIMEOUT says otherwise (the OTLP default is 10)
SHUTDOWN_TIMEOUT_S = 5.0  # the last flush at exit; a dead collector must not hold the process


def never_raise(fn: F) -> F:
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


def tracing_requested(flag: bool = False) -> bool:
    """`--tracing`, or LORA_SERVE_TRACING=1/true/yes/on."""
    return flag or os.environ.get(TRACING_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def setup_telemetry(instance_id: str | None = None) -> Telemetry | None:
    """Tracer and meter providers from the OTEL_* environment; None when OTEL_SDK_DISABLED=true.
    `instance_id`: the resource's service.instance.id (the replica id), unless OTEL_RESOURCE_ATTRIBUTES sets it.
    Raises ValueError for an exporter or protocol we do not know (a typo should not silently drop data)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    env_attributes = os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in env_attributes
    attributes = {} if named else {"service.name": DEFAULT_SERVICE_NAME}
    # Replicas share a service name; Jaeger and Prometheus tell them apart by this (the explicit setting wins).
    if instance_id and "service.instance.id=" not in env_attributes:
        attributes["service.instance.id"] = instance_id
    resource = Resource.create(attributes)
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


class Telemetry:
    """The tracer and meter providers of one process. Wherever it is passed as None, tracing is off."""

    def __init__(self, tracer_provider: TracerProvider, meter_provider: MeterProvider):
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self.tracer = tracer_provider.get_tracer("lora_serve")
        self.meter = meter_provider.get_meter("lora_serve")

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
