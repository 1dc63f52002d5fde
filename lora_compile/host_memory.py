"""How much memory this process may still take (for choices that cost a copy of the weights), how much it holds,
and giving freed heap back to the system."""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

_CGROUP = Path("/sys/fs/cgroup")


def available_memory_bytes() -> int | None:
    """The system's MemAvailable, capped by a cgroup v2 limit (a container sees the host's meminfo). None where
    neither can be read."""
    available = _meminfo_available()
    room = _cgroup_room()
    if room is not None:
        available = room if available is None else min(available, room)
    return available


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _cgroup_room() -> int | None:
    """memory.max less what the cgroup holds, not counting page cache the kernel can drop (memory.current counts
    the memory-mapped checkpoint, for one)."""
    try:
        limit = (_CGROUP / "memory.max").read_text().strip()
        if limit == "max":
            return None
        stat = dict(line.split() for line in (_CGROUP / "memory.stat").read_text().splitlines())
        used = int((_CGROUP / "memory.current").read_text()) - int(stat.get("inactive_file", 0))
        return max(0, int(limit) - used)
    except (OSError, ValueError):
        return None


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """This process's resident set (0 where /proc is missing)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def _process() -> ctypes.CDLL | None:
    """The process's own symbols (the allocator's calls among them), or None where they cannot be opened."""
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


_PROCESS = _process()


def _heap_allocated():
    """TCMalloc's count of the bytes its callers hold (`generic.current_allocated_bytes`, ~10 us), when it is
    loaded (the server's default, service.allocator); else None. Not glibc's mallinfo2: it walks every free chunk
    with each arena locked, 37 ms on a fragmented heap here, stalling the other threads' allocations."""
    numeric = getattr(_PROCESS, "MallocExtension_GetNumericProperty", None)
    if numeric is None:
        return None
    numeric.argtypes, numeric.restype = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t)], ctypes.c_int
    value = ctypes.c_size_t()
    if not numeric(b"generic.current_allocated_bytes", ctypes.byref(value)):
        return None

    def allocated() -> int:
        numeric(b"generic.current_allocated_bytes", ctypes.byref(value))
        return value.value
    return allocated


_ALLOCATED = _heap_allocated()


def heap_bytes() -> int:
    """Bytes of the heap this process's code holds, by TCMalloc's own count: unlike the resident set, it grows by
    what an allocation takes even where the allocator reuses pages an earlier one freed, and does not count freed
    pages the allocator has not given back. The resident set where TCMalloc is not loaded."""
    return _ALLOCATED() if _ALLOCATED is not None else resident_bytes()


def _heap_release():
    """The allocator's call that returns free pages to the system: TCMalloc's when it is loaded (the server's
    default, service.allocator), else glibc's malloc_trim; None elsewhere."""
    release = getattr(_PROCESS, "MallocExtension_ReleaseFreeMemory", None)
    if release is not None:
        return lambda: release()
    trim = getattr(_PROCESS, "malloc_trim", None)
    return (lambda: trim(0)) if trim is not None else None


_RELEASE = _heap_release()


def release_free_heap() -> None:
    """Give the heap's free pages back to the system (ctypes drops the GIL while it runs): after a large
    short-lived allocation, such as a refused grammar's, so the process's memory comes back down."""
    if _RELEASE is not None:
        _RELEASE()
