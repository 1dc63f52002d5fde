"""benchmarks.cpu_report: the CPU named as /proc/cpuinfo and torch see it, and oneDNN's own account of the kernels a
packed linear layer ran (ONEDNN_VERBOSE), read back from standard output."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import cpu_report
from lora_compile.model import packed_gemm


def test_describe_names_model_and_isa():
    line = cpu_report.describe(2)
    assert torch.backends.cpu.get_cpu_capability() in line and line.endswith("2 threads")
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    if model:
        assert model.group(1).strip() in line
    flags = set(re.search(r"^flags\s*:\s*(.+)$", cpuinfo, re.M).group(1).split())
    have = line.split("ISA: ", 1)[1].split(" (not:", 1)[0].split()
    assert set(have) == flags & set(cpu_report.ISA_FLAGS)


@pytest.mark.skipif(not packed_gemm.available(torch.device("cpu"), torch.float32), reason="no oneDNN packing")
def test_onednn_kernels_of_a_packed_linear():
    weight = torch.randn(256, 128)
    packed = packed_gemm.prepack(weight)
    x = torch.randn(9, 128)

    def run() -> None:
        for _ in range(3):
            packed_gemm.packed_linear(x, weight, packed)

    report = cpu_report.onednn_kernels(run)
    uses = [k for k in report.kernels if k.shape == "mb9ic128oc256"]
    assert len(uses) == 1 and uses[0].calls == 3 and uses[0].ms > 0, report.kernels
    assert any("isa:" in i for i in report.info)
    lines = report.lines()
    assert lines[0].startswith("oneDNN ISA: ") and "not reported" not in lines[0]
    # A second report in the same process still names the ISA (oneDNN prints it once per process).
    assert "not reported" not in cpu_report.onednn_kernels(run).lines()[0]


CAPPED = """
import torch
from benchmarks import cpu_report
from lora_compile.model import packed_gemm
weight, x = torch.randn(256, 128), torch.randn(9, 128)
packed = packed_gemm.prepack(weight)
print(cpu_report.describe(2))
report = cpu_report.onednn_kernels(lambda: packed_gemm.packed_linear(x, weight, packed))
print("IMPL", *sorted({k.implementation for k in report.kernels}))
"""


@pytest.mark.skipif(not packed_gemm.available(torch.device("cpu"), torch.float32), reason="no oneDNN packing")
def test_an_isa_capped_by_the_environment_is_named_and_holds():
    """An older CPU emulated on this one (docs/benchmarks.md): every kernel family runs AVX2, and the line says so."""
    if "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("the CPU has no AVX2")
    env = os.environ | {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", CAPPED], env=env, capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parent.parent, check=True).stdout
    line = next(s for s in out.splitlines() if s.startswith("CPU: "))
    assert "torch kernels: AVX2" in line and "capped: ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2" in line
    impls = next(s for s in out.splitlines() if s.startswith("IMPL")).split()[1:]
    assert impls and all("avx512" not in i and "amx" not in i for i in impls), impls
