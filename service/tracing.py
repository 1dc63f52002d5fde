"""Where the tracing names used to live, for the callers not yet moved (cli.py): telemetry is now
telemetry_setup.py (providers, exporters), telemetry_interceptor.py (gRPC server spans) and
telemetry_observer.py (request and step spans, metrics)."""
from .telemetry_interceptor import TracingInterceptor
from .telemetry_observer import TelemetryObserver
from .telemetry_setup import TRACING_ENV, Telemetry, describe_export, setup_telemetry, tracing_requested

__all__ = ["TRACING_ENV", "Telemetry", "TelemetryObserver", "TracingInterceptor", "describe_export",
           "setup_telemetry", "tracing_requested"]
