"""Giving the memory that loading freed back to the system.

Loading a model makes large temporaries (a GGUF tensor's codes and scales unpacked before packing, a float weight
before quantizing); freed, they stay in the allocator's free lists and count in the process's resident memory for
its lifetime. TCMalloc (which lora-serve preloads, as vLLM's CPU backend does) returns them on
MallocExtension_ReleaseFreeMemory; glibc's malloc on malloc_trim."""
from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)


def release_free_memory() -> str | None:
    """Ask the process's allocator to return its free memory; the function that did, or None."""
    try:
        process = ctypes.CDLL(None)
    except OSError:  # pragma: no cover - not a dynamically linked process
        return None
    for name, args in (("MallocExtension_ReleaseFreeMemory", ()), ("malloc_trim", (0,))):
        fn = getattr(process, name, None)
        if fn is not None:
            fn(*args)
            return name
    return None
