"""Transparent huge pages (THP) for the engine's large CPU tensors: weights, their packed copies, the KV pool.

A CPU decode step streams every weight once. On 4 KiB pages that is ~130k TLB entries for SmolLM2-135M in
float32, and where those pages landed decided speed: in some processes a second packed copy of the same weights
(the merged lone adapter) ran up to 1.08x faster than the base copy loaded first, in others not. With huge pages
the base copy was never more than 5 % behind, and the base step was faster in three of four paired processes (by
up to 24 %) and 6 % slower in the fourth, on a machine that drifts by about that much (docs/benchmarks.md, issue 34).

torch's CPU allocator aligns every allocation of 2 MiB or more to 2 MiB and advises the kernel to back it with
huge pages (madvise MADV_HUGEPAGE) when THP_MEM_ALLOC_ENABLE=1. It reads that variable once, at the process's
first such allocation; so importing lora_compile sets it before any engine allocates, unless the environment
already says otherwise (THP_MEM_ALLOC_ENABLE=0 turns it off). The kernel decides in the end: THP "never"
(/sys/kernel/mm/transparent_hugepage/enabled) gives none, which `status` reports at start.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

ENV = "THP_MEM_ALLOC_ENABLE"
_SYSFS = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# Whether this module set the variable (rather than the user): benchmarks.peers then gives peers the environment
# as the user gave it.
set_by_default = False


def enable_by_default() -> None:
    global set_by_default
    if ENV not in os.environ:
        os.environ[ENV] = "1"
        set_by_default = True


def kernel_mode() -> str | None:
    """The kernel's THP mode (always, madvise or never), or None where there is no THP (not Linux)."""
    try:
        text = _SYSFS.read_text()
    except OSError:
        return None
    chosen = re.search(r"\[(\w+)\]", text)
    return chosen.group(1) if chosen else None


def anon_huge_bytes() -> int | None:
    """Bytes of this process's anonymous memory in huge pages now (AnonHugePages), or None where unknown."""
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return None
    found = re.search(r"^AnonHugePages:\s+(\d+) kB", text, re.M)
    return int(found.group(1)) * 1024 if found else None


def status() -> str:
    """One line for the start log: the variable, the kernel's mode, and what is in huge pages now."""
    mode, held = kernel_mode(), anon_huge_bytes()
    if mode is None:
        return "transparent huge pages: not available on this system"
    line = f"transparent huge pages: {ENV}={os.environ.get(ENV, '0')}, kernel mode {mode}"
    if held is not None:
        line += f", {held / 2**20:.0f} MiB of this process in huge pages"
    if mode == "never":
        line += " (the kernel gives none: echo madvise > " + str(_SYSFS) + " lets the engine ask)"
    return line
