"""Several RunnerObservers behind the runner's one hook (tracing, and the Prometheus counters of /metrics)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from service.runner.reports import IterationResult, RunnerObserver
    from service.runner.request_state import RequestState


class ObserverGroup:
    """Several RunnerObservers behind the runner's one hook (tracing and Prometheus)."""

    def __init__(self, observers: Iterable[RunnerObserver]):
        self.observers = [o for o in observers if o is not None]

    def on_added(self, state: RequestState) -> None:
        for o in self.observers:
            o.on_added(state)

    def on_iteration(self, result: IterationResult) -> None:
        for o in self.observers:
            o.on_iteration(result)

    def on_finished(self, state: RequestState) -> None:
        for o in self.observers:
            o.on_finished(state)
