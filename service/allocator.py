"""The server's memory allocator: TCMalloc where the system has it, as vLLM's CPU backend preloads it.

A CPU decode step makes thousands of small allocations (each oneDNN GEMM call allocates and frees its descriptors
and scratch; the compiled graph's wrapper its buffers). Under glibc's malloc a tiny packed GEMM call took 15.6 us,
40 % of it in malloc/free (_int_malloc, malloc_consolidate); under TCMalloc 9.5 us. Whole decode steps on an
Intel Xeon (AVX-512, AMX) ran 6-11 % faster for the base model (docs/benchmarks.md, issue 34).

An allocator has to be in place before the process allocates anything, so it comes through LD_PRELOAD: `lora-serve`
re-executes itself once with TCMalloc preloaded when it finds the library (Debian: libtcmalloc-minimal4, which
scripts/setup.sh and the Dockerfile install) and the process does not have it yet. The PID stays the same (exec),
so supervisors and signals see one process. LORA_SERVE_ALLOCATOR=system keeps glibc's malloc. Torch-free: it runs
before anything heavy is imported.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ENV = "LORA_SERVE_ALLOCATOR"  # "tcmalloc" (the default) or "system"
CHOICES = ("tcmalloc", "system")
_TRIED = "LORA_SERVE_ALLOCATOR_PRELOADED"  # set across the exec: never exec twice (a preload the loader refused)
_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def choice() -> str:
    value = os.environ.get(ENV, CHOICES[0])
    if value not in CHOICES:
        raise SystemExit(f"lora-serve: {ENV}={value!r}: expected one of {', '.join(CHOICES)}")
    return value


def find_tcmalloc() -> str | None:
    """The path of a TCMalloc shared library on this system, or None."""
    for directory in _DIRS:
        for name in _NAMES:
            path = Path(directory) / name
            if path.is_file():
                return str(path)
    return None


def loaded() -> str | None:
    """The TCMalloc library mapped into this process, or None (glibc's malloc, or not Linux)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        if "libtcmalloc" in line:
            return line.split()[-1]
    return None


def reexec_with_tcmalloc() -> None:
    """Replace this process by itself with TCMalloc preloaded, where that is wanted, possible and not yet done.
    Call only from a process's entry point, before it imports torch (nothing else runs after exec)."""
    if choice() == "system" or os.environ.get(_TRIED) or loaded() is not None or not sys.platform.startswith("linux"):
        return
    path = find_tcmalloc()
    if path is None:
        return
    env = dict(os.environ, **{_TRIED: "1"})
    env["LD_PRELOAD"] = ":".join(p for p in (path, os.environ.get("LD_PRELOAD", "")) if p)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def status() -> str:
    """One line for the start log."""
    path = loaded()
    if path is not None:
        return f"memory allocator: TCMalloc ({path})"
    if choice() == "system":
        return f"memory allocator: glibc malloc ({ENV}=system)"
    return ("memory allocator: glibc malloc; TCMalloc not found (install libtcmalloc-minimal4: decode steps "
            "run faster with it)")
