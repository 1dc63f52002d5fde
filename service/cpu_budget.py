"""The CPUs the server may really use, and the OpenMP settings its compute threads run with.

A CPU decode step runs hundreds of parallel regions, and each ends at a barrier that waits for every thread of the
team. A thread the kernel gives to another process for a time slice holds up the whole team that long, at every
barrier. So the server
- sizes its team from the CPUs it may use: its affinity mask (taskset, cpusets) and the cgroup's CPU quota (a
  Kubernetes CPU limit), as `nproc` and container runtimes report them, not the host's core count;
- runs one compute thread fewer than that (at least one), as vLLM-CPU reserves a CPU for its scheduler process:
  the server's own other threads (the event loop, tokenizer, grammar compiles, adapter loaders) and a neighbour
  then take that CPU instead of a team member's. On 2 cores (docs/benchmarks.md): a 32-token completion beside a
  nice-0 busy loop took 1.10 s with one thread, 4.51 s with two (0.79 s alone with two, 1.13 s with one);
- keeps libgomp's own wait policy (spin a while, then sleep): PASSIVE took 2.5x as long alone.
What each costs alone and beside a busy loop: python -m benchmarks.noisy_neighbour. An operator's own
OMP_NUM_THREADS / OMP_WAIT_POLICY are kept. Torch-free: it runs before torch is imported (OpenMP reads these once,
when torch loads).
"""
from __future__ import annotations

import math
import os
from pathlib import Path

_CGROUP = Path("/sys/fs/cgroup")
WAIT_POLICY = None  # libgomp's own (spin a while, then sleep)


def usable_cpus() -> int:
    """CPUs in this process's affinity mask, capped by the cgroup's CPU quota (rounded up), at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def _cgroup_quota() -> float | None:
    """CPUs' worth of time per period the cgroup may use (v2 cpu.max, v1 cfs_quota_us / cfs_period_us); None
    where unlimited or unreadable."""
    try:
        quota, period = (_CGROUP / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((_CGROUP / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((_CGROUP / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def compute_threads() -> int:
    """The team's size: one CPU fewer than usable_cpus(), at least one."""
    return max(1, usable_cpus() - 1)


def openmp_settings(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The OpenMP variables the server runs with: the operator's where set, else ours."""
    environ = os.environ if environ is None else environ
    settings = {"OMP_NUM_THREADS": environ.get("OMP_NUM_THREADS") or str(compute_threads())}
    policy = environ.get("OMP_WAIT_POLICY") or WAIT_POLICY
    if policy:
        settings["OMP_WAIT_POLICY"] = policy
    return settings


def apply() -> dict[str, str]:
    """Set them in this process's environment (before torch is imported); returns them, for the start log."""
    settings = openmp_settings()
    os.environ.update(settings)
    return settings
