"""The one server starter of the benchmarks: `python -m service` (lora-serve), or a peer's server, as a process on
loopback ports.

Its output is read all along by a thread (a pipe nobody reads fills up and stalls the server: the access log alone
does that under load), the last lines kept for the error message of a server that exits early. lora-serve is ready
when it logs its "ready on" line (after warm-up); a peer's server when its /health answers 200.
"""
from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
READY = re.compile(r"lora-serve ready on ")
START_TIMEOUT_S = 900.0  # a compiled start on a 2-core machine, cold Inductor cache


def free_port() -> int:
    """A loopback port free now (the server binds it a moment later: good enough on a machine of our own)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server process on loopback ports `port` (gRPC; 0: none) and `http_port` (0: none), its output drained.
    `on_line`: called with each line of its output, in the reading thread (a benchmark's log parser)."""

    def __init__(self, argv: list[str], *, port: int = 0, http_port: int = 0, env: dict[str, str] | None = None,
                 on_line: Callable[[str], None] | None = None, name: str | None = None):
        self.argv, self.port, self.http_port = argv, port, http_port
        self.name = name or Path(argv[0]).name  # (for messages)
        self.tail: deque[str] = deque(maxlen=40)
        self._on_line = on_line
        self._ready, self._exited = threading.Event(), threading.Event()
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, errors="replace")
        threading.Thread(target=self._drain, daemon=True).start()

    @property
    def target(self) -> str:
        """The gRPC door, as the SDK takes it."""
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        """The HTTP door's base URL, or "" when it is off."""
        return f"http://127.0.0.1:{self.http_port}" if self.http_port else ""

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.tail.append(line)
            if READY.search(line):
                self._ready.set()
            if self._on_line is not None:
                self._on_line(line)
        self._exited.set()

    def _failed(self, why: str) -> RuntimeError:
        self.stop()  # (one that never got ready is no use to the caller, and would outlive it)
        return RuntimeError(f"{self.name} {why}; its last output:\n{''.join(self.tail)}")

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> ServerProcess:
        """Until lora-serve's ready line."""
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.5):
            if self._exited.is_set() or self.proc.poll() is not None:
                raise self._failed(f"exited with {self.proc.wait()} before it was ready")
            if time.monotonic() > deadline:
                raise self._failed(f"was not ready within {timeout:.0f} s")
        return self

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> ServerProcess:
        """Until GET /health on the HTTP door answers 200 (a peer's server: vLLM's is up once it answers)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise self._failed(f"exited with {self.proc.returncode} before it was ready")
            try:
                urllib.request.urlopen(f"{self.http_url}/health", timeout=2).read()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    raise self._failed(f"was not ready within {timeout:.0f} s") from None
                time.sleep(1)

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM (a graceful drain), SIGKILL after `timeout`."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def lora_serve(model: Path | None, *flags: str, http: bool = True, env: dict[str, str] | None = None,
               on_line: Callable[[str], None] | None = None, wait: bool = True,
               ports: tuple[int, int] | None = None) -> ServerProcess:
    """`python -m service` (what the `lora-serve` script runs) serving `model` (None: the demo model) with `flags`,
    on free ports (or `ports`: (gRPC, HTTP)), the HTTP door on unless `http` is false; ready when it returns unless
    `wait` is false (start several, then wait_ready() each: they warm up side by side)."""
    port, http_port = ports or (free_port(), free_port() if http else 0)
    argv = [sys.executable, "-m", "service", *(["--model", str(model)] if model else []),
            "--port", str(port), "--http-port", str(http_port), *flags]
    server = ServerProcess(argv, port=port, http_port=http_port, env=env, on_line=on_line, name="lora-serve")
    return server.wait_ready() if wait else server

