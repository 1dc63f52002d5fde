"""A real HAProxy in front of lora-serve processes on loopback ports (benchmarks.scaleout): the shipped
deploy/haproxy/haproxy.cfg with only its addresses rewritten.

The one copy, for the scale-out benchmark and tests (tests/replicas.py imports it; benchmarks import nothing from
tests/): the config rendering, the check timing read from it, and the process with its stats socket.
"""
from __future__ import annotations

import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.server import ROOT, free_port

HAPROXY_CFG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"


def render_haproxy_config(servers: dict[str, tuple[int, int]], ports: tuple[int, int], stats_socket: Path) -> str:
    """The shipped config with loopback addresses and no Docker DNS. `servers`: name -> (gRPC port, HTTP port);
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
    """inter, fastinter, fall, rise and the check timeout (seconds / counts) of a config's default-server (the
    shipped config's when `text` is None)."""
    text = text or HAPROXY_CFG.read_text()
    line = re.search(r"(?m)^  default-server (.*)$", text).group(1).split()
    value = {k: line[line.index(k) + 1] for k in ("inter", "fastinter", "fall", "rise")}
    timeout = re.search(r"(?m)^  timeout check (\S+)", text).group(1)
    return {"inter": _seconds(value["inter"]), "fastinter": _seconds(value["fastinter"]),
            "fall": int(value["fall"]), "rise": int(value["rise"]), "timeout": _seconds(timeout)}


def _seconds(value: str) -> float:
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)?", value).groups()
    return float(number) * {"ms": 1e-3, "s": 1, "m": 60, None: 1e-3}[unit]


def haproxy_binary() -> str | None:
    return shutil.which("haproxy")


class HAProxy:
    def __init__(self, servers: dict[str, tuple[int, int]], workdir: Path, edit: Callable[[str], str] = str):
        """`edit`: applied to the rendered config (e.g. a round-robin variant)."""
        binary = haproxy_binary()
        if binary is None:
            raise RuntimeError("haproxy is not installed: scripts/setup.sh installs it (apt-get install haproxy)")
        self.port, self.http_port = free_port(), free_port()
        self.socket = workdir / "haproxy.sock"
        self.config = workdir / "haproxy.cfg"
        self.config.write_text(edit(render_haproxy_config(servers, (self.port, self.http_port), self.socket)))
        self.timing = check_timing(self.config.read_text())
        checked = subprocess.run([binary, "-c", "-q", "-f", str(self.config)], capture_output=True, text=True)
        if checked.returncode != 0:
            raise RuntimeError(f"haproxy rejects the rendered config: {checked.stderr}")
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
        """Server name -> "UP", "DOWN", "UP 1/2", ... in `backend` ("replicas": gRPC, "openai": HTTP)."""
        rows = [r.split(",") for r in self.command("show stat").splitlines() if r and not r.startswith("#")]
        return {r[1]: r[17] for r in rows if r[0] == backend and r[1] not in ("FRONTEND", "BACKEND")}

    def wait_state(self, name: str, state: str, timeout: float, backend: str = "replicas") -> float:
        """Until `name` is `state` in `backend`; returns the seconds it took."""
        t0 = time.monotonic()
        while (current := self._states_or_none(backend).get(name)) != state:
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"{name} is {current}, not {state}, after {timeout:.1f}s")
            time.sleep(0.02)
        return time.monotonic() - t0

    def _states_or_none(self, backend: str) -> dict[str, str]:
        try:
            return self.states(backend)
        except OSError:  # the socket is not there yet
            return {}

    def down_within(self) -> float:
        """Longest a SERVING -> NOT_SERVING change can take to mark a server DOWN: a check in flight (inter +
        timeout), then `fall` failed ones at fastinter; twice that, for a busy machine."""
        t = self.timing
        return 2 * (t["inter"] + t["timeout"] + t["fall"] * (t["fastinter"] + t["timeout"]))

    def up_within(self) -> float:
        """Longest a server takes to be marked UP (`rise` checks), twice that for a busy machine."""
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
