"""What CPU a benchmark ran on, and which oneDNN kernels ran: so that figures from different machines compare.

`describe()` names the CPU model, core count and ISA flags that decide our kernels (AVX2 / AVX-512 / bf16 / AMX),
with torch's kernel capability. `onednn_kernels(fn)` runs `fn` with oneDNN's verbose mode on (ONEDNN_VERBOSE,
switched on around the call through torch.backends.mkldnn.verbose), reads what it printed on standard output
(file descriptor 1, where oneDNN writes) and sums the executed primitives by kind, implementation and shape.
"""
from __future__ import annotations

import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from service import allocator

# The flags that decide which kernels oneDNN and Inductor generate on x86.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni",
             "amx_tile", "amx_bf16")

# What caps the ISA below the CPU's: oneDNN's kernels (either name), and ATen's and Inductor's vector code
# (Inductor picks its ISA from ATEN_CPU_CAPABILITY).
ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")


def _cpuinfo() -> tuple[str, set[str]]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU", set()
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    return (model.group(1).strip() if model else "unknown CPU"), set(flags.group(1).split() if flags else ())


def describe(threads: int | None = None) -> str:
    """One line: model, cores this process may use, the ISA flags present and absent, torch's kernel capability,
    the memory allocator (service.allocator)."""
    model, flags = _cpuinfo()
    cores = len(os.sched_getaffinity(0))
    have = [f for f in ISA_FLAGS if f in flags]
    missing = [f for f in ISA_FLAGS if f not in flags]
    line = (f"CPU: {model}, {cores} cores; ISA: {' '.join(have) or '-'} (not: {' '.join(missing) or '-'}); "
            f"torch kernels: {torch.backends.cpu.get_cpu_capability()}")
    # An ISA capped by the environment (emulating an older CPU on this one) changes every kernel: said on the line.
    caps = [f"{var}={os.environ[var]}" for var in ISA_CAPS if os.environ.get(var)]
    line += f"; capped: {' '.join(caps)}" if caps else ""
    line += "; allocator: " + ("TCMalloc" if allocator.loaded() else "glibc malloc")  # it moves step times
    return line + (f"; {threads} threads" if threads else "")


@dataclass
class KernelUse:
    kind: str  # oneDNN primitive kind: inner_product, matmul, reorder, ...
    implementation: str  # e.g. brg_matmul:avx2, brgemm:avx512_core, gemm:jit
    shape: str  # oneDNN's problem description, e.g. mb9ic576oc1536
    calls: int = 0
    ms: float = 0.0


@dataclass
class OneDnnReport:
    info: list[str]  # oneDNN's own info lines: version, runtime, ISA
    kernels: list[KernelUse]  # executed primitives, most time first
    wall_ms: float  # the wall time of the reported call

    def lines(self, top: int = 12) -> list[str]:
        total = sum(k.ms for k in self.kernels)
        isa = next((i.split("isa:", 1)[1] for i in self.info if "isa:" in i), "not reported")
        out = [f"oneDNN ISA: {isa}; executed primitives {total:.1f} ms = {100 * total / max(self.wall_ms, 1e-9):.0f}% "
               f"of {self.wall_ms:.1f} ms wall"]
        by_impl: dict[tuple[str, str], list[float]] = {}
        for k in self.kernels:
            calls_ms = by_impl.setdefault((k.kind, k.implementation), [0, 0.0])
            calls_ms[0] += k.calls
            calls_ms[1] += k.ms
        for (kind, impl), (calls, ms) in sorted(by_impl.items(), key=lambda kv: -kv[1][1]):
            out.append(f"  {kind:14s} {impl:22s} {calls:6d} calls {ms:9.1f} ms ({100 * ms / max(total, 1e-9):4.1f}%)")
        out.append("  top shapes:")
        for k in self.kernels[:top]:
            out.append(f"    {k.kind:14s} {k.implementation:22s} {k.shape:24s} {k.calls:6d} calls "
                       f"{k.ms / k.calls * 1000:8.1f} us each")
        return out


def parse_verbose(lines: Iterable[str], wall_ms: float = 0.0) -> OneDnnReport:
    """Sum oneDNN verbose lines (v1 format: onednn_verbose,v1,primitive,exec,cpu,KIND,IMPL,...,PROBLEM,MS)."""
    info: list[str] = []
    uses: dict[tuple[str, str, str], KernelUse] = {}
    for line in lines:
        parts = line.strip().split(",")
        if len(parts) < 4 or parts[0] != "onednn_verbose":
            continue
        fields = parts[2:] if parts[1] == "v1" else parts[1:]
        if fields[0] == "info" and len(fields) > 1 and not fields[1].startswith("template:"):
            info.append(",".join(fields[1:]))
        elif fields[:2] == ["primitive", "exec"] and len(fields) >= 6:
            kind, impl, shape, ms = fields[3], fields[4], fields[-2], float(fields[-1])
            use = uses.setdefault((kind, impl, shape), KernelUse(kind, impl, shape))
            use.calls += 1
            use.ms += ms
    return OneDnnReport(info, sorted(uses.values(), key=lambda u: -u.ms), wall_ms)


# oneDNN prints its info lines (version, ISA) once per process: kept from the first report for the later ones.
_info: list[str] = []


def onednn_kernels(fn: Callable[[], object]) -> OneDnnReport:
    """Run fn() with oneDNN verbose on, its standard output captured; the summary of what oneDNN executed."""
    with tempfile.TemporaryFile() as captured:
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(captured.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                t0 = time.perf_counter()
                fn()
                wall_ms = 1000 * (time.perf_counter() - t0)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        captured.seek(0)
        text = captured.read().decode(errors="replace")
    report = parse_verbose(text.splitlines(), wall_ms)
    _info[:] = report.info or _info
    report.info = report.info or list(_info)
    return report
