"""Real lora-serve replica processes and a real HAProxy in front of them, on loopback ports, for the scale-out
test and benchmark. HAProxy runs the shipped deploy/haproxy/haproxy.cfg with only its addresses rewritten."""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HAPROXY_CFG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
READY = re.compile(r"lora-serve ready on (\S+):(\d+)")


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


def render_haproxy_config(servers: dict[str, tuple[int, int]], ports: tuple[int, int], stats_socket: Path) -> str:
    """The shipped config with loopback addresses and no Docker DNS. `servers`: name → (gRPC port, HTTP port);
    `ports`: HAProxy's own (gRPC, HTTP). Each backend keeps its server order, only the addresses change."""
    text = HAPROXY_CFG.read_text()
    text = re.sub(r"(?m)^  bind :50051 ", f"  bind 127.0.0.1:{ports[0]} ", text)
    text = re.sub(r"(?m)^  bind :8000$", f"  bind 127.0.0.1:{ports[1]}", text)
    text = re.sub(r"(?m)^  stats socket \S+", f"  stats socket {stats_socket}", text)
    text = re.sub(r"(?ms)^resolvers docker\n.*?\n\n", "", text)
    text = text.replace(" resolvers docker", "")

    def server(m: re.Match) -> str:
        door = {"50051": 0, "8000": 1}[m[2]]
        return f"  server {m[1]} 127.0.0.1:{servers[m[1]][door]}" if m[1] in servers else ""
    text = re.sub(r"(?m)^  server (\S+) \S+:(\d+)$", server, text)
    return re.sub(r"\n\n+(?=  )", "\n", text)


def check_timing(text: str | None = None) -> dict[str, float]:
    """inter, fastinter, fall, rise and the check timeout (seconds / counts) of the config's default-server."""
    text = text or HAPROXY_CFG.read_text()
    line = re.search(r"(?m)^  default-server (.*)$", text).group(1).split()
    value = {k: line[line.index(k) + 1] for k in ("inter", "fastinter", "fall", "rise")}
    timeout = re.search(r"(?m)^  timeout check (\S+)", text).group(1)
    return {"inter": _seconds(value["inter"]), "fastinter": _seconds(value["fastinter"]),
            "fall": int(value["fall"]), "rise": int(value["rise"]), "timeout": _seconds(timeout)}


def _seconds(value: str) -> float:
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)?", value).groups()
    return float(number) * {"ms": 1e-3, "s": 1, "m": 60, None: 1e-3}[unit]


class HAProxy:
    def __init__(self, servers: dict[str, tuple[int, int]], workdir: Path, edit: Callable[[str], str] = str):
        """`edit`: applied to the rendered config (e.g. a benchmark's round-robin variant)."""
        binary = shutil.which("haproxy")
        if binary is None:
            raise AssertionError("haproxy is not installed: scripts/setup.sh installs it (apt-get install haproxy)")
        self.port, self.http_port = free_port(), free_port()
        self.socket = workdir / "haproxy.sock"
        self.config = workdir / "haproxy.cfg"
        self.config.write_text(edit(render_haproxy_config(servers, (self.port, self.http_port), self.socket)))
        self.timing = check_timing(self.config.read_text())
        checked = subprocess.run([binary, "-c", "-q", "-f", str(self.config)], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stderr
        self.log_path = workdir / "haproxy.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - open while the process runs
        self.proc = subprocess.Popen([binary, "-db", "-f", str(self.config)], stdout=self._log,
                                     stderr=subprocess.STDOUT)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def command(self, line: str) -> str:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(self.socket))
            s.sendall(line.encode() + b"\n")
            out = b""
            while chunk := s.recv(65536):
                out += chunk
        return out.decode()

    def states(self, backend: str = "replicas") -> dict[str, str]:
        """Server name → "UP", "DOWN", "UP 1/2", ... in `backend` ("replicas": gRPC, "openai": HTTP)."""
        rows = [r.split(",") for r in self.command("show stat").splitlines() if r and not r.startswith("#")]
        return {r[1]: r[17] for r in rows if r[0] == backend and r[1] not in ("FRONTEND", "BACKEND")}

    def wait_state(self, name: str, state: str, timeout: float, backend: str = "replicas") -> float:
        """Until `name` is `state` in `backend`; returns the seconds it took."""
        t0 = time.monotonic()
        while (current := self._states_or_none(backend).get(name)) != state:
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"{name} is {current}, not {state}, after {timeout:.1f}s")
            time.sleep(0.02)
        return time.monotonic() - t0

    def _states_or_none(self, backend: str) -> dict[str, str]:
        try:
            return self.states(backend)
        except OSError:  # the socket is not there yet
            return {}

    def down_within(self) -> float:
        """Longest a SERVING → NOT_SERVING change can take to mark a server DOWN: a check in flight (inter +
        timeout), then `fall` failed ones at fastinter; twice that, for a busy machine."""
        t = self.timing
        return 2 * (t["inter"] + t["timeout"] + t["fall"] * (t["fastinter"] + t["timeout"]))

    def up_within(self) -> float:
        t = self.timing
        return 2 * (t["rise"] * (t["inter"] + t["timeout"]))

    def stop(self) -> str:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()
        return self.log_path.read_text()
