"""Real lora-serve replica processes on loopback ports, for the scale-out tests; the HAProxy in front of them is the
benchmarks' (benchmarks/haproxy.py: the shipped deploy/haproxy/haproxy.cfg with only its addresses rewritten), which
tests may import and benchmarks never import from tests."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from benchmarks.haproxy import HAPROXY_CFG, HAProxy, check_timing, render_haproxy_config

ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"lora-serve ready on (\S+):(\d+)")
__all__ = ["HAPROXY_CFG", "HAProxy", "Replica", "check_timing", "free_port", "render_haproxy_config"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Replica:
    """`python -m service` on a fixed loopback port (HAProxy's config names it), eager (fast start on 2 cores)."""

    def __init__(self, replica_id: str, ports: tuple[int, int], model: Path, adapters: dict[str, Path], *extra: str,
                 env: dict[str, str] | None = None):
        self.replica_id, (self.port, self.http_port) = replica_id, ports
        self.env = env or {}
        self.args = [sys.executable, "-m", "service", "--no-compile", "--host", "127.0.0.1", "--port", str(self.port),
                     "--http-port", str(self.http_port), "--replica-id", replica_id, "--model", str(model),
                     *[a for name, path in adapters.items() for a in ("--adapter", f"{name}={path}")], *extra]
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []
        self.ready = threading.Event()

    def start(self) -> Replica:
        self.lines, self.ready = [], threading.Event()
        self.proc = subprocess.Popen(self.args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=os.environ | {"PYTHONUNBUFFERED": "1"} | self.env)
        threading.Thread(target=self._read, args=(self.proc, self.lines, self.ready), daemon=True).start()
        return self

    @staticmethod
    def _read(proc: subprocess.Popen, lines: list[str], ready: threading.Event) -> None:
        for line in proc.stdout:
            lines.append(line)
            if READY.search(line):
                ready.set()
        ready.set()  # exited: wait_ready() reports it

    def wait_ready(self, timeout: float) -> None:
        if not self.ready.wait(timeout) or self.proc.poll() is not None:
            raise AssertionError(f"{self.replica_id} not ready within {timeout:.0f}s:\n{self.log()}")

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def log(self, tail: int | None = 40) -> str:
        """The replica's output so far: its last `tail` lines (for a failure message), or all of it (None)."""
        return "".join(self.lines if tail is None else self.lines[-tail:])

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


