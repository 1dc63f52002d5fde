"""deploy/haproxy/haproxy.cfg: valid for the installed HAProxy, hashing on x-adapter-id, and its grpc.health.v1
check (raw HTTP/2 bytes from service.tools.haproxy_check) really tells SERVING from NOT_SERVING: a real HAProxy
against a real server, down while it warms up, up once it serves, down again while it drains."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from service.server import ServerConfig
from service.tools.haproxy_check import check_request, serving_response, tcp_check_lines
from tests.replicas import HAPROXY_CFG, HAProxy, free_port, render_haproxy_config
from tests.service_harness import ServerThread, shared_engine


def test_config_hashes_on_the_adapter_header_over_h2():
    text = HAPROXY_CFG.read_text()
    backend = text.split("backend replicas", 1)[1].split("frontend openai", 1)[0]
    assert "balance hdr(x-adapter-id)" in backend and "hash-type consistent" in backend
    assert re.search(r"(?m)^  bind :50051 proto h2$", text)
    assert re.search(r"(?m)^  default-server proto h2 check ", text)
    # The check lines are exactly what the tool prints (regenerate with python -m service.tools.haproxy_check).
    assert [line.strip() for line in backend.splitlines() if line.strip().startswith(("option tcp", "tcp-check"))] \
        == tcp_check_lines()
    # The HTTP door: the same hashing, /health as the check, the same servers in the same order (so an adapter
    # lands on the same replica through either door).
    openai = text.split("backend openai", 1)[1]
    assert "balance hdr(x-adapter-id)" in openai and "hash-type consistent" in openai
    assert "option httpchk GET /health" in openai and "http-check expect status 200" in openai
    names = [re.findall(r"(?m)^  server (\S+) \S+:(\d+)$", part) for part in (backend, openai)]
    assert [n for n, _ in names[0]] == [n for n, _ in names[1]] and names[0]
    assert {p for _, p in names[0]} == {"50051"} and {p for _, p in names[1]} == {"8000"}


def test_check_bytes_are_one_grpc_health_call():
    raw = check_request()
    assert raw.startswith(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    assert b"/grpc.health.v1.Health/Check" in raw and b"application/grpc" in raw and raw.endswith(b"\x00" * 5)
    from grpc_health.v1 import health_pb2
    expected = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING).SerializeToString()
    assert serving_response() == b"\x00" + len(expected).to_bytes(4, "big") + expected


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="needs haproxy (scripts/setup.sh installs it)")
def test_shipped_config_and_rendered_config_are_valid():
    for path in (HAPROXY_CFG,):
        proc = subprocess.run(["haproxy", "-c", "-f", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr  # (compose's host names do not resolve here: a warning only)
    rendered = render_haproxy_config({"replica-1": (1, 2)}, (3, 4), HAPROXY_CFG.parent / "x.sock")
    assert "resolvers" not in rendered and "bind 127.0.0.1:3 proto h2" in rendered and "bind 127.0.0.1:4\n" in rendered
    assert re.findall(r"(?m)^  server .*$", rendered) == ["  server replica-1 127.0.0.1:1", "  server replica-1 127.0.0.1:2"]


def test_health_check_follows_serving_state(tmp_path):
    server = ServerThread(shared_engine(), ServerConfig(port=0, grace_period_s=10.0), warmup=False)
    proxy = None
    try:
        proxy = HAProxy({"replica-1": (server.server.port, free_port())}, tmp_path)  # (gRPC only here)
        proxy.wait_state("replica-1", "DOWN", proxy.down_within())  # warming up: NOT_SERVING
        server.run(server.server.warmup())
        proxy.wait_state("replica-1", "UP", proxy.up_within())
        server.run(server.server.health.enter_graceful_shutdown())  # what drain() does first
        proxy.wait_state("replica-1", "DOWN", proxy.down_within())
        assert server.server.port is not None  # still listening: the check read NOT_SERVING, not a closed port
        log = proxy.stop()
        proxy = None
        # The SERVING step failed on an answer (not the connect, not a timeout waiting for bytes).
        assert "did not match content (binary) at step 4" in log and "Layer7 timeout" not in log, log
    finally:
        if proxy is not None:
            proxy.stop()
        server.stop()
