"""Give freed heap memory back to the OS after large requests.

A burst of ~1 MB requests leaves their freed buffers in glibc's malloc arenas: measured here, 12 x 8 refused
1 MB prompts took a server from 304 to 389 MiB and it stayed there; malloc_trim(0) brought it back to 314 MiB.
So a large request schedules one trim shortly after it (debounced: a burst trims once): malloc_trim, or under
TCMalloc (the server's default allocator, service.allocator) its MallocExtension_ReleaseFreeMemory
(lora_compile.host_memory.release_free_heap). A refused
request is still held by its exception's traceback cycle until the collector runs, so the trim follows a
collection (of what is not frozen: gc.freeze() after warm-up keeps this cheap)."""
from __future__ import annotations

import asyncio
import gc
import logging
import time

from lora_compile.host_memory import release_free_heap

log = logging.getLogger(__name__)
LARGE_REQUEST_BYTES = 256 * 1024


class HeapTrimmer:
    def __init__(self, delay_s: float = 0.5):
        self._delay_s = delay_s
        self._pending: asyncio.TimerHandle | None = None

    def after_large_request(self) -> None:
        """Call on the event loop when a request of LARGE_REQUEST_BYTES or more arrives."""
        if self._pending is not None:
            self._pending.cancel()
        self._pending = asyncio.get_running_loop().call_later(self._delay_s, self._run)

    def _run(self) -> None:
        self._pending = None
        t0 = time.perf_counter()
        gc.collect()  # cheap after gc.freeze(): only what serving allocated is walked
        log.debug("heap: collection after a large request took %.1f ms", 1e3 * (time.perf_counter() - t0))
        # ctypes releases the GIL: the trim (madvise over the freed pages) runs beside the event loop, not in it
        asyncio.get_running_loop().run_in_executor(None, release_free_heap)
