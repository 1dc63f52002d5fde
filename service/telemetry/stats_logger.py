"""The periodic stats line, as vLLM's LoggingStatLogger prints it, every --log-stats-interval seconds (10, vLLM's
default):

  Avg generation throughput: 41.5 tokens/s, Running: 6 reqs, Waiting: 2 reqs, CPU KV cache usage: 37.5%,
  Prefix cache hit rate: 62.0%          (one line, wrapped here)

Fed by what the runner already reports, never by a call into the engine: generated tokens are counted from
each iteration's StepOutput (the runner's on_iteration hook), and the rest is a scheduler snapshot
(EngineRunner.stats(): plain counters, read on the event loop). Throughput and the prefix-cache hit rate are
over the interval since the last line (the hit rate only when prompts were looked up in it); "Preemptions"
appears when some happened in it. An idle server (nothing generated in this interval or the last, nothing
running or waiting) logs the line at DEBUG, as vLLM does, so that an idle log stays quiet.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from service.runner.reports import IterationResult, SchedulerStats
    from service.runner.request_state import RequestState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Mark:
    """The counters at the start of an interval."""

    time: float
    generated: int
    prefix_queries: int
    prefix_hits: int
    preemptions: int


class StatsLogger:
    """A RunnerObserver counting generated tokens, and the task that logs a line every `interval_s` seconds."""

    def __init__(self, stats: Callable[[], SchedulerStats], device: str, interval_s: float = 10.0):
        self._stats = stats
        self.interval_s = interval_s
        # vLLM's wording: "GPU KV cache usage" on CUDA, the device type otherwise.
        kind = device.partition(":")[0]
        self._kv_device = "GPU" if kind == "cuda" else kind.upper()
        self._generated = 0
        self._was_busy = False
        self._mark: _Mark | None = None  # set by start()
        self._task: asyncio.Task | None = None

    # --- RunnerObserver ----------------------------------------------------------------------------------
    def on_added(self, state: RequestState) -> None:
        pass

    def on_iteration(self, result: IterationResult) -> None:
        if result.step is not None:  # (None: nothing ran, or the step failed)
            self._generated += len(result.step.seq_ids)  # one token for each sequence sampled

    def on_finished(self, state: RequestState) -> None:
        pass

    # --- the periodic line -------------------------------------------------------------------------------
    def start(self) -> None:
        """On the server's event loop."""
        self._mark = self._snapshot_mark()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="stats-logger")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        failed = False
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.log_stats()
            except Exception:  # noqa: BLE001 - a log line must not stop the server; say it once
                if not failed:
                    log.exception("the stats line failed; the server goes on")
                failed = True

    def log_stats(self) -> None:
        """Log the line for the interval since the last one (or since start()), and start the next interval."""
        s = self._stats()
        now = self._snapshot_mark(s)
        mark = self._mark or now
        elapsed = now.time - mark.time
        throughput = (now.generated - mark.generated) / elapsed if elapsed > 0 else 0.0
        parts = ["Avg generation throughput: %.1f tokens/s", "Running: %d reqs", "Waiting: %d reqs"]
        args: list[float] = [throughput, s.num_running, s.num_waiting]
        if now.preemptions > mark.preemptions:
            parts.append("Preemptions: %d")
            args.append(now.preemptions - mark.preemptions)
        parts.append(f"{self._kv_device} KV cache usage: %.1f%%")
        args.append(100 * s.kv_cache_usage)
        queries = now.prefix_queries - mark.prefix_queries
        if s.prefix_caching and queries > 0:
            parts.append("Prefix cache hit rate: %.1f%%")
            args.append(100 * (now.prefix_hits - mark.prefix_hits) / queries)
        busy = bool(throughput or s.num_running or s.num_waiting)
        level = logging.INFO if busy or self._was_busy else logging.DEBUG
        self._was_busy, self._mark = busy, now
        log.log(level, ", ".join(parts), *args)

    def _snapshot_mark(self, s: SchedulerStats | None = None) -> _Mark:
        s = s if s is not None else self._stats()
        return _Mark(time.monotonic(), self._generated, s.prefix_cache_queries, s.prefix_cache_hits,
                     s.num_preemptions)
