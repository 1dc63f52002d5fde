"""Importing the packages has no side effect a library user would trip over: no thread is started."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _import_all(package: str) -> tuple[int, str]:
    """Import every module of `package` (sub-packages too) in a fresh process: (module count, live threads)."""
    code = (
        f"import importlib, pkgutil, threading, {package}\n"
        f"names = [m.name for m in pkgutil.walk_packages({package}.__path__, '{package}.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "print(len(names), [t.name for t in threading.enumerate()])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    modules, threads = out.stdout.split(" ", 1)
    return int(modules), threads.strip()


def test_importing_every_engine_module_starts_no_thread():
    modules, threads = _import_all("lora_compile")
    assert modules >= 17 and threads == "['MainThread']"


def test_importing_every_service_module_starts_no_thread():
    """The engine thread (service.runner.engine_thread) starts on first use, not when the service is imported."""
    modules, threads = _import_all("service")
    assert modules >= 20 and threads == "['MainThread']"
