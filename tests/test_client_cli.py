"""`lora-client` against servers that are not there: a port nobody listens on, and a peer that accepts the
connection but never answers. One line on stderr, a non-zero exit, and the default deadline applies (that the
client imports no torch is main's tests/test_client_install.py)."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from service.client.cli import DEFAULT_TIMEOUTS, client_parser

ROOT = Path(__file__).resolve().parent.parent


def client(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service", "client", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_every_command_has_a_default_deadline_and_help_says_so():
    sub = next(a for a in client_parser()._actions if a.dest == "command")
    assert set(sub.choices) == set(DEFAULT_TIMEOUTS)
    assert DEFAULT_TIMEOUTS["health"] is not None and DEFAULT_TIMEOUTS["generate"] is None
    text = " ".join(client_parser().format_help().split())
    assert f"default: {DEFAULT_TIMEOUTS['health']:g} for health" in text


def test_nothing_listening_is_one_line_and_exit_1():
    proc = client("--target", f"127.0.0.1:{free_port()}", "health")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("error: UNAVAILABLE") and proc.stderr.count("\n") == 1, proc.stderr


def test_a_silent_peer_fails_at_the_default_deadline():
    """Accepted by the kernel, never a grpc answer: without a deadline grpc waits for its 20 s connect timeout
    and then says UNAVAILABLE; with the default one, DEADLINE_EXCEEDED."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        target = "127.0.0.1:%d" % silent.getsockname()[1]
        proc = client("--target", target, "health")
    assert proc.returncode == 1 and proc.stdout == ""
    want = f"error: DEADLINE_EXCEEDED: Deadline Exceeded (no answer from {target} within " \
           f"{DEFAULT_TIMEOUTS['health']:g}s; --timeout)\n"
    assert proc.stderr == want

