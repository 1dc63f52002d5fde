"""The server's allocator (service.allocator): a process that asks for TCMalloc re-executes itself once with it
preloaded, in the same PID; LORA_SERVE_ALLOCATOR=system keeps glibc's malloc; anything else is refused."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from service import allocator

ROOT = Path(__file__).resolve().parents[1]
# What an entry point does: report the PID, ask for TCMalloc, report what is mapped (runs twice when it re-executes).
PROBE = ("import os; from service import allocator; print('pid', os.getpid(), flush=True); "
         "allocator.reexec_with_tcmalloc(); print('loaded', allocator.loaded()); print(allocator.status())")


def probe(**env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.ENV, allocator._TRIED)}
    return subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=clean | env)


@pytest.mark.skipif(allocator.find_tcmalloc() is None, reason="no TCMalloc here (apt-get install libtcmalloc-minimal4)")
def test_reexecutes_once_with_tcmalloc_in_the_same_pid():
    out = probe()
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    pids = [line for line in lines if line.startswith("pid ")]
    assert len(pids) == 2 and pids[0] == pids[1], lines  # ran twice: before and after exec, one process
    assert lines[-2].startswith("loaded ") and "libtcmalloc" in lines[-2], lines
    assert lines[-1].startswith("memory allocator: TCMalloc"), lines


def test_system_keeps_glibc_malloc():
    out = probe(**{allocator.ENV: "system"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len([line for line in lines if line.startswith("pid ")]) == 1, lines  # no exec
    assert lines[-2:] == ["loaded None", f"memory allocator: glibc malloc ({allocator.ENV}=system)"]


def test_unknown_allocator_is_refused_with_the_choices():
    out = probe(**{allocator.ENV: "jemalloc"})
    assert out.returncode == 1
    assert f"{allocator.ENV}='jemalloc': expected one of tcmalloc, system" in out.stderr
