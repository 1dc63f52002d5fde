"""The client (SDK and lora-client) is torch-free: the base install has no torch, and neither the SDK nor the
CLI imports it, so a client call does not pay torch's import (seconds) on every run."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _imported(*args: str) -> tuple[set[str], subprocess.CompletedProcess]:
    proc = subprocess.run([sys.executable, "-X", "importtime", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    modules = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "service" in modules or "service.client" in modules, proc.stderr[-2000:]
    return modules, proc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sdk_and_cli_import_no_torch():
    modules, _ = _imported("-c", "import service.client")
    assert "torch" not in modules and "lora_compile" not in modules
    modules, proc = _imported("-m", "service", "client", "--help")
    assert proc.returncode == 0 and "torch" not in modules and "lora_compile" not in modules
    # A real call too (to a port nothing listens on): it fails, without torch.
    modules, proc = _imported("-m", "service", "client", "--target", f"127.0.0.1:{_free_port()}", "--timeout", "1",
                              "health")
    assert proc.returncode != 0 and "torch" not in modules and "lora_compile" not in modules


def test_base_install_is_the_client():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {d.split("=")[0].split(">")[0].split("[")[0].strip() for d in project["dependencies"]}
    assert "torch" not in names and {"grpcio", "protobuf"} <= names
    assert any(d.startswith("torch==") for d in project["optional-dependencies"]["server"])
    assert "lora-serve[server]" in project["optional-dependencies"]["test"]
