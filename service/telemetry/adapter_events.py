"""How the adapter manager's events (lora_manager.AdapterEvent) read as metrics: one mapping for both exporters
(OTLP in observer.py, Prometheus in prometheus.py)."""
from __future__ import annotations

from dataclasses import dataclass

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
