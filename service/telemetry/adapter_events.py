"""How the adapter manager's events (lora_compile.lora.manager.AdapterEvent) read as metrics: one mapping for both exporters
(OTLP in observer.py, Prometheus in prometheus.py)."""
from __future__ import annotations

from dataclasses import dataclass

# Seconds: a read of a small adapter takes milliseconds, a slot copy less (both exporters use these bounds).
LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# event kind → (phase of the load-time histogram, result of the loads counter)
_LOAD_EVENTS = {"load": ("disk_read", "ok"), "load_failed": (None, "error"), "device_copy": ("device_copy", None)}


@dataclass(frozen=True)
class AdapterMetric:
    evicted_tier: str | None = None   # "device" or "host": count one eviction there
    load_result: str | None = None    # "ok" or "error": count one load
    phase: str | None = None          # "disk_read" or "device_copy": observe the event's duration
    seconds: float = 0.0


def adapter_metric(event) -> AdapterMetric:
    if event.kind.startswith("evict_"):
        return AdapterMetric(evicted_tier=event.kind.removeprefix("evict_"))
    phase, result = _LOAD_EVENTS.get(event.kind, (None, None))
    return AdapterMetric(load_result=result, phase=phase, seconds=(event.end_ns - event.start_ns) / 1e9)
