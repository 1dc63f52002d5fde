"""The adapter loader: a small thread pool that reads, validates and converts adapters off the engine thread,
one load per adapter however many callers ask for it at once (single-flight).

What runs here is file reads, safetensors' parser and numpy (adapters.load_adapter), plus `torch.from_numpy`
and, on CUDA, one `pin_memory` per tensor: no parallel torch op, so the loader threads never get an OpenMP team
of their own (service/runner/engine_thread.py). Only the copy into a device slot is left to the engine thread.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from .adapters import LoRAAdapter


@dataclass(frozen=True)
class LoadResult:
    """A finished read: the adapter (or the error), and when its disk read and validation ran (wall clock)."""

    name: str
    adapter: LoRAAdapter | None
    error: BaseException | None
    start_ns: int
    end_ns: int


class AdapterLoader:
    def __init__(self, read: Callable[[str, str], LoRAAdapter], on_done: Callable[[LoadResult], None],
                 num_threads: int = 2, delay_s: float = 0.0):
        self._read = read
        self._on_done = on_done  # runs in the loader thread before the future resolves (the host cache fills)
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="adapter-loader")
        self._inflight: dict[str, Future[LoadResult]] = {}
        self._lock = threading.Lock()
        # Tests and benchmarks only: sleep this long in every load, as a slow disk would.
        self.delay_s = delay_s
        self.num_loads = 0  # loads started (for tests and metrics: N concurrent asks of one adapter make one)

    def submit(self, name: str, path: str) -> Future[LoadResult]:
        """The load of `name` already under way, or a new one. The future never raises: errors are in the result."""
        with self._lock:
            future = self._inflight.get(name)
            if future is None:
                future = self._inflight[name] = self._pool.submit(self._load, name, path)
                self.num_loads += 1
            return future

    def run(self, fn: Callable[..., LoRAAdapter], *args) -> Future[LoRAAdapter]:
        """Any read on the loader's threads (an explicit registration's), without single-flight."""
        return self._pool.submit(fn, *args)

    @property
    def num_loading(self) -> int:
        with self._lock:
            return len(self._inflight)

    def loading(self, name: str) -> bool:
        with self._lock:
            return name in self._inflight

    def _load(self, name: str, path: str) -> LoadResult:
        start_ns = time.time_ns()
        adapter, error = None, None
        try:
            if self.delay_s:
                time.sleep(self.delay_s)
            adapter = self._read(name, path)
        except Exception as exc:  # noqa: BLE001 - handed to whoever waits on this adapter
            error = exc
        result = LoadResult(name, adapter, error, start_ns, time.time_ns())
        try:
            self._on_done(result)
        except Exception as exc:  # noqa: BLE001 - the waiters get it as the load's error, never a raising future
            result = LoadResult(name, None, exc, start_ns, result.end_ns)
        finally:
            with self._lock:
                self._inflight.pop(name, None)
        return result

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def gather(name: str, futures: list[Future[LoadResult]]) -> Future[LoadResult]:
    """One future for several loads (a mix's members): it resolves when the last does, with the first error any of
    them had and the span from the first start to the last end."""
    combined: Future[LoadResult] = Future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future[LoadResult]) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        results = [f.result() for f in futures]
        error = next((r.error for r in results if r.error is not None), None)
        combined.set_result(LoadResult(name, None, error, min(r.start_ns for r in results),
                                       max(r.end_ns for r in results)))

    for future in futures:
        future.add_done_callback(one_done)
    return combined
