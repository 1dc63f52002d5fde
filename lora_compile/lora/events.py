"""What the adapter tiers did, kept for telemetry: the manager appends under its lock; the runner takes the
batch once a step and hands it to the observers (service/telemetry/adapter_events.py reads them as metrics)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdapterEvent:
    """"load" (disk read + validation, fields start/end), "load_failed", "device_copy" (into a slot, between
    steps), "evict_host", "evict_device"."""

    kind: str
    name: str
    start_ns: int
    end_ns: int
    nbytes: int = 0


class AdapterEventLog:
    """Not locked on its own: LoRAManager appends and takes under its lock."""

    def __init__(self) -> None:
        self._events: list[AdapterEvent] = []

    def add(self, kind: str, name: str, start_ns: int, end_ns: int, nbytes: int = 0) -> None:
        self._events.append(AdapterEvent(kind, name, start_ns, end_ns, nbytes))

    def take(self) -> list[AdapterEvent]:
        events, self._events = self._events, []
        return events
