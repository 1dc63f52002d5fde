"""What the runner reports (service/runner/engine_runner.py): each iteration's result, a snapshot for metrics, and the
observer protocol that reads them. Observers read; they never steer the scheduler."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from lora_compile import Engine
    from lora_compile.core.step_output import StepOutput
    from service.runner.request_state import RequestState


@dataclass(frozen=True)
class SchedulerStats:
    """What the scheduler holds right now (read by /metrics at scrape time)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float        # share of the KV cache's usable blocks held by running sequences (0..1)
    num_kv_blocks: int           # usable blocks of block_size tokens
    block_size: int
    prefix_caching: bool
    cache_dtype: str             # EngineConfig.kv_cache_dtype, as configured ("auto": the model's dtype)
    # Monotonic since start: prompt tokens looked up in / found in the prefix cache, and preemptions.
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    max_loras: int               # adapters a batch may hold (device slots)
    running_adapters: tuple[str, ...]
    waiting_adapters: tuple[str, ...]
    device_adapters: tuple[str, ...]   # adapters in a device slot now
    host_adapters: tuple[str, ...]     # registered adapters whose weights sit in host memory
    adapter_tiers: dict[str, int]      # known adapters per fastest tier: device, host, disk


def scheduler_stats(engine: Engine, in_flight: Iterable[RequestState], backlog: Iterable[RequestState]
                    ) -> SchedulerStats:
    """The snapshot of `engine` with the runner's choices `in_flight` (handed to the scheduler) and those still in
    their call's `backlog`; no engine call (the KV counters are plain attributes), so cheap on the event loop."""
    cfg, adapters, kv = engine.config, engine.adapters, engine.kv_cache
    in_flight = list(in_flight)
    running = [s for s in in_flight if s.running and not s.done]
    waiting = [s for s in (*in_flight, *backlog) if not s.running and not s.aborted]
    device, host = adapters.residency()
    return SchedulerStats(
        num_running=len(running), num_waiting=len(waiting), kv_cache_usage=kv.usage,
        num_kv_blocks=kv.num_blocks, block_size=kv.block_size, prefix_caching=cfg.enable_prefix_caching,
        cache_dtype=cfg.kv_cache_dtype, prefix_cache_queries=kv.prefix_cache_queries,
        prefix_cache_hits=kv.prefix_cache_hits,
        num_preemptions=engine.num_preemptions, max_loras=cfg.max_loras_per_batch,
        running_adapters=tuple(sorted({s.request.adapter for s in running if s.request.adapter})),
        waiting_adapters=tuple(sorted({s.request.adapter for s in waiting if s.request.adapter})),
        device_adapters=device, host_adapters=host, adapter_tiers=adapters.tier_counts())


@dataclass
class IterationResult:
    admitted: list[RequestState]
    rejected: list[tuple[RequestState, Exception]]
    stepped: list[RequestState]
    preempted: list[RequestState] = field(default_factory=list)
    step_error: Exception | None = None
    step: StepOutput | None = None
    adapter_events: list = field(default_factory=list)  # lora.manager.AdapterEvent: loads, copies, evictions


class RunnerObserver(Protocol):
    """Reports on requests (telemetry). Called on the event loop; reads events and results, changes nothing."""

    def on_added(self, state: RequestState) -> None:
        """In add_request, in the caller's context (e.g. its trace)."""

    def on_iteration(self, result: IterationResult) -> None:
        """After each iteration, once the next is under way."""

    def on_finished(self, state: RequestState) -> None:
        """The request's stream ended (its last output sent, an error, or the client gone)."""
