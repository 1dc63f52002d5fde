"""How much memory this process may still take (for choices that cost a copy of the weights)."""
from __future__ import annotations

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
