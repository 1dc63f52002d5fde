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


def _imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports too)."""
    import ast

    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from service import http_api`
    return names


def test_neither_door_imports_the_other():
    """The gRPC door (service/grpc_api/) and the HTTP door (service/http_api/) share what they both need through
    modules above or beside them (service/server.py wires them; prepare, security, lifecycle...), never through
    each other."""
    doors = {"grpc_api": "service.http_api", "http_api": "service.grpc_api"}
    crossings = [f"{path.relative_to(ROOT)} imports {name}"
                 for door, other in doors.items() for path in sorted((ROOT / "service" / door).glob("*.py"))
                 for name in sorted(_imported_modules(path)) if name == other or name.startswith(other + ".")]
    assert crossings == []
