"""Connection limits of both doors, on the wire (raw sockets) and with real clients: the cap on open connections
refuses cleanly while established clients are served; idle, half-sent (slowloris) and silent connections are
closed; an over-size request head gets 431; and a process at its file-handle limit logs it once and keeps serving.
"""
from __future__ import annotations

import contextlib
import http.client
import json
import resource
import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.client import LoraServeClient
from service.connections import ConnectionLimits
from service.server import ServerConfig
from tests.service_harness import ServerThread, shared_engine, wait_for
from tests.test_service_process import ServeProcess, _free_port

DEADLINE_S = 60  # client-side bound on anything the server should do "after a timeout": a stuck server, not a slow one
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + an empty SETTINGS frame
SETTINGS, GOAWAY = 4, 7
READY, IDLE = grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.IDLE
MAX_TOKENS = 24  # per stream: still mid-stream when a test pauses the engine after its first token


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S)


def _read_to_eof(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection (a reset counts as closed)."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def _get(sock: socket.socket, path: str = "/health") -> tuple[int, bytes]:
    """One request on an open keep-alive connection (the connection stays open)."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response.status, response.read()


def _health_on_new_connection(port: int) -> int | None:
    """/health's status on a new connection; None when the connection was closed without an answer."""
    try:
        with _connect(port) as sock:
            return _get(sock)[0]
    except (OSError, http.client.HTTPException):
        return None


def _assert_refused(sock: socket.socket) -> None:
    """Over the cap: a 503 that says why and when to retry, then the server closes the connection."""
    head, _, body = _read_to_eof(sock).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), head
    assert b"retry-after: 1" in head and b"connection: close" in head
    error = json.loads(body)["error"]
    assert error == {"message": f"this server has {CAP} HTTP connections open, its limit (--max-connections); retry "
                     "shortly, or reuse a connection", "type": "service_unavailable_error", "param": None,
                     "code": "unavailable"}


def _frames(data: bytes) -> list[tuple[int, bytes]]:
    frames = []
    while len(data) >= 9:
        length, kind = int.from_bytes(data[:3], "big"), data[3]
        frames.append((kind, data[9:9 + length]))
        data = data[9 + length:]
    return frames


@contextlib.contextmanager
def engine_paused(served: ServerThread):
    """No engine step runs inside (the event loop, and so both doors, keep going)."""
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait(DEADLINE_S)

    done = served.submit(served.server.runner.run_in_engine_thread(hold))
    assert entered.wait(DEADLINE_S)
    try:
        yield
    finally:
        release.set()
        done.result(DEADLINE_S)


class HttpStream:
    """A streaming completion read by the openai client in a thread; .tokens counts what has arrived."""

    def __init__(self, port: int, max_tokens: int = MAX_TOKENS):
        import openai

        self.tokens, self.usage, self.error = 0, None, None
        self.started = threading.Event()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                               timeout=DEADLINE_S)
        self._stream = client.completions.create(
            model="", prompt="Once upon a time", max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        assert self.started.wait(DEADLINE_S)

    def _read(self) -> None:
        try:
            for chunk in self._stream:
                self.tokens += bool(chunk.choices)
                self.usage = chunk.usage or self.usage
                self.started.set()
        except Exception as e:  # noqa: BLE001 - surfaced by result()
            self.error = e
            self.started.set()

    def result(self):
        self._thread.join(DEADLINE_S)
        assert self.error is None, self.error
        return self.usage


# --- the cap on open connections (long timeouts: only the cap closes anything here) ------------------------------
CAP = 4


@pytest.fixture(scope="module")
def capped():
    server = ServerThread(shared_engine(), ServerConfig(port=0, http_port=0, connections=ConnectionLimits(
        max_connections=CAP, timeout_keep_alive_s=DEADLINE_S, header_timeout_s=DEADLINE_S)))
    yield server
    server.stop()


def test_http_cap_refuses_new_connections_while_established_ones_are_served(capped):
    """H21 (docs/errors.md)."""
    port = capped.server.http_port
    keep_alive = _connect(port)                  # connection 1: a keep-alive client
    assert _get(keep_alive)[0] == 200
    stream = HttpStream(port)                    # connection 2: a generation in flight
    with engine_paused(capped):
        assert capped.server.runner.num_running == 1  # so the rest of the stream is generated after the refusal
        idle = [_connect(port) for _ in range(CAP - 2)]  # connections 3 and 4: never send a byte
        for _ in range(3):
            with _connect(port) as extra:
                _assert_refused(extra)
        tokens_at_refusal = stream.tokens
        assert _get(keep_alive)[0] == 200
    usage = stream.result()
    assert usage.completion_tokens == MAX_TOKENS and stream.tokens > tokens_at_refusal
    for sock in idle:
        sock.close()
    # Two slots free again (the stream's connection idles on; the client keeps it): new connections are served.
    wait_for(lambda: _health_on_new_connection(port) == 200, DEADLINE_S, "a slot to free")
    keep_alive.close()


def test_grpc_cap_closes_new_connections_while_established_ones_are_served(capped):
    with capped.client() as client:              # connection 1
        stream = client.generate("Once upon a time", max_new_tokens=MAX_TOKENS, ignore_eos=True)
        chunks = [next(stream)]
        with engine_paused(capped):
            established = [_connect(capped.server.port) for _ in range(CAP - 1)]  # connections 2..4
            for sock in established:
                sock.sendall(PREFACE)
                assert _frames(sock.recv(65536))[0][0] == SETTINGS
            with _connect(capped.server.port) as extra:  # closed by grpc at once, before its SETTINGS
                assert _read_to_eof(extra) == b""
        chunks += list(stream)
        assert sum(len(c.token_ids) for c in chunks) == MAX_TOKENS and chunks[-1].finish_reason == "length"
        assert client.complete("Hi", max_new_tokens=2).usage.completion_tokens == 2
    for sock in established:
        sock.close()

    def accepted() -> bool:
        with _connect(capped.server.port) as sock:
            return sock.recv(65536) != b""
    wait_for(accepted, DEADLINE_S, "a gRPC slot to free")


# --- timeouts (short: what the server closes, and that it keeps serving meanwhile) -------------------------------
KEEP_ALIVE_S, HEADER_S, GRPC_IDLE_S = 0.5, 0.5, 1.5


@pytest.fixture(scope="module")
def timed():
    server = ServerThread(shared_engine(), ServerConfig(port=0, http_port=0, connections=ConnectionLimits(
        max_connections=CAP, timeout_keep_alive_s=KEEP_ALIVE_S, header_timeout_s=HEADER_S,
        grpc_max_connection_idle_s=GRPC_IDLE_S)))
    yield server
    server.stop()


def test_idle_http_connections_are_closed_and_their_slots_reused(timed):
    port = timed.server.http_port
    used = _connect(port)
    assert _get(used)[0] == 200  # idle after a response
    idle = [used] + [_connect(port) for _ in range(CAP - 1)]  # idle from the start: never a byte
    for sock in idle:
        assert _read_to_eof(sock) == b""  # closed by the server, without a response
        sock.close()
    # The server closed them (and freed their slots before its FIN): the cap's worth of new connections is served.
    fresh = [_connect(port) for _ in range(CAP)]
    assert [_get(sock)[0] for sock in fresh] == [200] * CAP
    for sock in fresh:
        sock.close()


def test_slowloris_request_head_is_closed_after_the_header_timeout(timed, caplog):
    port = timed.server.http_port
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 4096  # never finished
    sock = _connect(port)
    closed, answered, sent = False, False, 0
    deadline = time.monotonic() + DEADLINE_S
    while not closed and time.monotonic() < deadline and sent < len(head):
        try:
            sock.send(head[sent:sent + 1])
            sent += 1
        except (BrokenPipeError, ConnectionResetError):
            closed = True
            break
        if sent == 8 and not answered:  # meanwhile, other requests are answered
            answered = _health_on_new_connection(port) == 200
        if select.select([sock], [], [], 0.02)[0]:
            closed = _read_to_eof(sock) == b""
    sock.close()
    assert answered and closed, (answered, closed, sent)
    assert sent < len(head)
    assert any("did not arrive within 0.5s (--header-timeout)" in r.getMessage() for r in caplog.records)


def test_a_request_body_that_trickles_in_gets_408_after_the_header_timeout(timed, caplog):
    """A head that arrives whole, then a body a byte at a time: the body has the head's deadline from the head's
    end, then a 408 in our words and the connection closes; meanwhile others are answered."""
    port = timed.server.http_port
    body = b'{"model": "x", "prompt": "hi"}'
    sock = _connect(port)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body[:2])
    reply, sent, answered = b"", 2, False
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline and sent < len(body) - 1:
        if select.select([sock], [], [], 0.05)[0]:
            reply = _read_to_eof(sock)
            break
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.send(body[sent:sent + 1])
            sent += 1
        answered = answered or _health_on_new_connection(port) == 200
    sock.close()
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 Request Timeout\r\n") and b"connection: close" in head, (reply, sent)
    assert "did not arrive within 0.5s of its headers" in json.loads(payload)["error"]["message"]
    assert answered and sent < len(body) - 1
    assert any("request body did not arrive within 0.5s" in r.getMessage() for r in caplog.records)


def test_a_tls_handshake_that_never_ends_is_closed_after_the_header_timeout(tmp_path):
    """With TLS on the HTTP door: a connection that opens and never sends its ClientHello is closed after the
    head deadline (it was asyncio's 60 s), and TLS clients are served meanwhile."""
    from tests.certs import CertificateAuthority
    from service.security import SecurityConfig, TlsConfig

    ca = CertificateAuthority(tmp_path)
    cert = ca.issue("server", server=True)
    server = ServerThread(shared_engine(), ServerConfig(
        port=0, http_port=0, security=SecurityConfig(tls=TlsConfig(str(cert.cert), str(cert.key))),
        connections=ConnectionLimits(header_timeout_s=HEADER_S)))
    try:
        port = server.server.http_port
        t0 = time.monotonic()
        with _connect(port) as silent:
            import ssl
            context = ssl.create_default_context(cafile=str(ca.pem.cert))
            with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S) as raw, \
                    context.wrap_socket(raw, server_hostname="localhost") as tls:
                assert _get(tls)[0] == 200  # a TLS client, served while the silent one waits
            assert _read_to_eof(silent) == b""
        assert time.monotonic() - t0 < 20 * HEADER_S, "the handshake was not bounded by the head deadline"
    finally:
        server.stop()


def test_huge_request_head_gets_431(timed):
    """H20 (docs/errors.md)."""
    port = timed.server.http_port
    with _connect(port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
        reply = _read_to_eof(sock)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), reply[:200]
    assert b"content-type: application/json" in head and b"connection: close" in head
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_argument"
    assert "over 16384 bytes" in error["message"] and "--h11-max-incomplete-event-size" in error["message"]
    with _connect(port) as sock:  # what h11 cannot parse: 400, in JSON as well
        sock.sendall(b"NOT HTTP\r\n\r\n")
        head, _, body = _read_to_eof(sock).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 Bad Request\r\n"), head
    assert json.loads(body)["error"]["message"] == "the request is not valid HTTP/1.1"
    assert _health_on_new_connection(port) == 200


def test_silent_grpc_connection_is_closed_after_the_handshake_timeout(timed):
    with _connect(timed.server.port) as sock:  # TCP only: never the HTTP/2 preface
        frames = _frames(_read_to_eof(sock))
    assert frames[0][0] == SETTINGS and frames[-1][0] == GOAWAY, frames  # (a WINDOW_UPDATE between them)
    assert b"handshake timeout" in frames[-1][1][8:]  # GOAWAY's debug data, after last-stream-id and error code


def test_idle_grpc_channel_gets_goaway_while_a_stream_on_another_completes(timed):
    states: list[grpc.ChannelConnectivity] = []
    # (its own connection: channels to one target otherwise share one, and the stream's is never idle)
    with timed.client() as client, grpc.insecure_channel(
            timed.target, options=[("grpc.use_local_subchannel_pool", 1)]) as idle:
        stream = client.generate("Once upon a time", max_new_tokens=MAX_TOKENS, ignore_eos=True)
        chunks = [next(stream)]
        with engine_paused(timed):  # the stream stays open for as long as the idle channel takes
            idle.subscribe(states.append)
            health_pb2_grpc.HealthStub(idle).Check(health_pb2.HealthCheckRequest(), timeout=DEADLINE_S)
            wait_for(lambda: READY in states and IDLE in states[states.index(READY):], DEADLINE_S,
                     "the idle channel's GOAWAY")  # (a channel whose connection got GOAWAY goes back to IDLE)
        chunks += list(stream)
    assert sum(len(c.token_ids) for c in chunks) == MAX_TOKENS and chunks[-1].finish_reason == "length"


# --- the process at its file-handle limit --------------------------------------------------------------------
NOFILE = 256
PROCESS_TOKENS = 16  # (a batch of 2 there: both streams run at once)


def _low_nofile() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))  # soft = hard: lora-serve cannot raise it


def _flood(port: int, n: int, log: list[str], until: str | None = None) -> list[socket.socket]:
    """Up to n connections that never send a byte, or fewer once the server logs `until`."""
    socks = []
    while len(socks) < n and not (until and any(until in line for line in log)):
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
        socks.append(sock)
        select.select([], [sock], [], 1)  # paced by the server's accepts (its listen queue full: a second)
    return socks


def _served_through_a_flood(server: ServeProcess, http_port: int, expect: str, stop_at_it: bool,
                            grpc_flood: bool) -> None:
    """Established clients of both doors are served while the flood holds every handle it can get (until the
    server logs `expect`, if stop_at_it); /health answers on a kept-alive connection during it and on a new
    connection after it."""
    keep_alive = _connect(http_port)
    assert _get(keep_alive)[0] == 200
    stream = HttpStream(http_port, PROCESS_TOKENS)
    with LoraServeClient(server.target) as client:
        grpc_stream = client.generate("Once upon a time", max_new_tokens=PROCESS_TOKENS, ignore_eos=True)
        grpc_chunks = [next(grpc_stream)]
        flood = _flood(http_port, NOFILE + 44, server.lines, until=expect if stop_at_it else None)
        if grpc_flood:
            flood += _flood(server.port, NOFILE + 44, server.lines)
        wait_for(lambda: any(expect in line for line in server.lines), DEADLINE_S, expect)
        assert _get(keep_alive)[0] == 200
        grpc_chunks += list(grpc_stream)
        assert sum(len(c.token_ids) for c in grpc_chunks) == PROCESS_TOKENS
        assert stream.result().completion_tokens == PROCESS_TOKENS
        assert client.complete("Hi", max_new_tokens=2).usage.completion_tokens == 2  # a new call, flood still on
    for sock in flood:
        sock.close()
    wait_for(lambda: _health_on_new_connection(http_port) == 200, DEADLINE_S, "/health on a new connection")
    keep_alive.close()


def _lines_about_handles(log: str) -> list[str]:
    return [line for line in log.splitlines() if any(s in line for s in (
        "open files", "out of system resource", "refusing new ones", "File descriptor limit"))]


@pytest.mark.slow
def test_process_at_its_file_handle_limit_refuses_cleanly_logs_once_and_keeps_serving():
    """`lora-serve` under RLIMIT_NOFILE 256, flooded with more connections than it has handles. With the caps
    derived from the limit, the flood is refused before the handles run out (one log line). With a cap set above
    what the limit allows, accept() fails for lack of handles: one log line, no traceback per failed accept.
    Both serve their established clients throughout."""
    ports = [_free_port(), _free_port()]
    common = ("--timeout-keep-alive", str(DEADLINE_S), "--grace-period", "5")
    with ThreadPoolExecutor(2) as pool:  # (started side by side: start-up is most of this test's time)
        starting = [pool.submit(ServeProcess, "--http-port", str(ports[0]), *common, preexec_fn=_low_nofile),
                    pool.submit(ServeProcess, "--http-port", str(ports[1]), "--max-connections", "1000", *common,
                                preexec_fn=_low_nofile)]
    servers = [s.result() for s in starting if s.exception() is None]
    try:
        assert len(servers) == 2, [s.exception() for s in starting]
        derived, overcommitted = servers
        assert ("at most 96 open connections per door (file-handle limit 256, 64 kept for files and logs)"
                in "".join(derived.lines))
        assert "--max-connections 1000 on 2 doors can hold 2000 file handles" in "".join(overcommitted.lines)
        # Derived caps: the flood is refused on both doors (HTTP logs it); the flood goes on past the limit.
        _served_through_a_flood(derived, ports[0], "refusing new ones", stop_at_it=False, grpc_flood=True)
        # Over the limit: accept() fails; HTTP only, as grpc core logs that itself, once a second while it lasts.
        _served_through_a_flood(overcommitted, ports[1], "cannot accept HTTP connections", stop_at_it=True,
                                grpc_flood=False)
    finally:
        for server in servers:
            server.proc.kill()
            server.proc.wait()
            server.reader.join(DEADLINE_S)  # every line it wrote
    for server in servers:
        assert "Traceback" not in "".join(server.lines), "".join(server.lines)[-4000:]
    # Once, then at most once a minute (so a few lines at most, however slow this machine is).
    about = _lines_about_handles("".join(derived.lines))
    assert 1 <= len(about) <= 3 and about[0].endswith(
        "HTTP door: 96 connections open (--max-connections); refusing new ones (503) until some close"), about
    about = _lines_about_handles("".join(overcommitted.lines))
    assert 1 <= len(about) <= 3 and "cannot accept HTTP connections: Too many open files" in about[0], about
