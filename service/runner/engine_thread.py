"""The one thread that runs torch in a serving process: the engine is built, warmed up, stepped, and reads
adapter files there, and nowhere else.

Why one: torch's CPU build parallelises with libgomp, which gives every thread that enters a parallel region a
worker team of its own. Once two threads have done so the teams outnumber the cores, and libgomp then lets idle
workers spin only briefly before sleeping (GOMP_SPINCOUNT's throttled mode), so each of a step's thousands of
small parallel regions pays a wake-up. Measured on 2 cores, batch 8 (python -m benchmarks.server_step): a
decode step of ~40 ms takes 75-107 ms once a second thread has run any parallel torch work, even while that
thread sits idle.
"""
from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


@functools.cache  # (thread-safe enough: functools.cache holds a lock while it fills the entry)
def _engine_thread() -> tuple[ThreadPoolExecutor, int]:
    """Started on first use, not at import: importing the service starts no thread."""
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
    return executor, executor.submit(threading.get_ident).result()


def ident() -> int:
    """The engine thread's `threading.get_ident()`."""
    return _engine_thread()[1]


def call(fn: Callable[..., T], *args: Any) -> T:
    """Run `fn` in the engine thread and wait for it (start-up code, benchmarks)."""
    executor, engine_ident = _engine_thread()
    if threading.get_ident() == engine_ident:
        return fn(*args)
    return executor.submit(fn, *args).result()


async def run(fn: Callable[..., T], *args: Any) -> T:
    """Run `fn` in the engine thread without blocking the event loop; calls never overlap."""
    return await asyncio.get_running_loop().run_in_executor(_engine_thread()[0], fn, *args)
