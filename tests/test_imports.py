"""Importing the engine package has no side effect a library user would trip over: no thread is started."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_importing_every_engine_module_starts_no_thread():
    code = (
        "import importlib, pkgutil, threading, lora_compile\n"
        "names = [m.name for m in pkgutil.iter_modules(lora_compile.__path__)]\n"
        "for name in names:\n"
        "    importlib.import_module('lora_compile.' + name)\n"
        "print(len(names), [t.name for t in threading.enumerate()])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    modules, threads = out.stdout.split(" ", 1)
    assert int(modules) >= 18 and threads.strip() == "['MainThread']", out.stdout + out.stderr


def test_importing_every_service_module_starts_no_thread():
    """The engine thread (service.runner.engine_thread) starts on first use, not when the service is imported."""
    code = (
        "import importlib, pkgutil, threading, service\n"
        "names = [m.name for m in pkgutil.walk_packages(service.__path__, 'service.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "print(len(names), [t.name for t in threading.enumerate()])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    modules, threads = out.stdout.split(" ", 1)
    assert int(modules) >= 20 and threads.strip() == "['MainThread']", out.stdout + out.stderr
