"""uvicorn serving the HTTP door as a task on the event loop the grpc.aio server runs on (one loop, one runner).

The socket is bound here (not by uvicorn, which exits the process when a bind fails), so a taken port is an
OSError at start like the gRPC port's, and port 0 reports the port it got. Signals stay with lora-serve: SIGTERM
drains both doors (service/server.py), then this server stops.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import ssl
from collections.abc import Generator

import uvicorn

from service.connections import ConnectionLimits, install_accept_error_handler
from service.http_api.h11_guard import DoorGuard, GuardedH11Protocol
from service.security import TlsConfig

log = logging.getLogger(__name__)

LISTEN_BACKLOG = 2048  # connections the kernel queues for accept()


class _EmbeddedServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, handshake_timeout_s: float):
        super().__init__(config)
        self.handshake_timeout_s = handshake_timeout_s

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # lora-serve's own handlers drain both doors

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's, with TLS handshakes bounded by the head deadline (--header-timeout; asyncio's default is
        60 s, during which a connection that never finishes its handshake is not yet counted against the cap).
        uvicorn has no setting for it: its create_server call gets the argument for the start-up alone."""
        loop = asyncio.get_running_loop()
        if self.config.ssl is None:
            return await super().startup(sockets)
        loop.create_server = functools.partial(type(loop).create_server, loop,
                                               ssl_handshake_timeout=self.handshake_timeout_s)
        try:
            await super().startup(sockets)
        finally:
            del loop.create_server


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port ("[::]" and "::1" are IPv6; "0.0.0.0" every IPv4 address)."""
    host = host.strip("[]")
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (not SO_REUSEPORT: a taken port must fail)
        if family == socket.AF_INET6 and host in ("::", ""):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class HttpServer:
    def __init__(self, app, host: str, port: int, tls: TlsConfig | None = None,
                 connections: ConnectionLimits = ConnectionLimits()):
        self._app, self._host, self._requested_port, self._tls = app, host, port, tls
        self._limits = connections
        self.guard = DoorGuard(max_connections=connections.per_door(doors=2),  # (beside the gRPC door)
                               header_timeout_s=connections.header_timeout_s,
                               max_head_bytes=connections.h11_max_incomplete_event_size)
        self._restore_handler = None
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task | None = None
        self.port: int | None = None

    async def start(self) -> int:
        sock = bind(self._host, self._requested_port)
        self.port = sock.getsockname()[1]
        tls, limits = self._tls, self._limits
        config = uvicorn.Config(
            self._app, lifespan="off", log_config=None, access_log=False, timeout_graceful_shutdown=1,
            # uvicorn's h11 protocol with the cap, head deadline and 431 (h11_guard.py); pinned, not "auto".
            http=functools.partial(GuardedH11Protocol, guard=self.guard),
            timeout_keep_alive=limits.timeout_keep_alive_s,  # (typed int by uvicorn; any delay works)
            h11_max_incomplete_event_size=limits.h11_max_incomplete_event_size,
            # asyncio accepts up to `backlog` connections per loop turn, and passes it to listen() as well
            # (the listen queue is set back below).
            backlog=limits.accept_batch(),
            ssl_certfile=tls.cert_file if tls else None, ssl_keyfile=tls.key_file if tls else None,
            ssl_ca_certs=tls.client_ca_file if tls else None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls and tls.client_ca_file else ssl.CERT_NONE)
        self._server = _EmbeddedServer(config, limits.header_timeout_s)
        self._restore_handler = install_accept_error_handler(asyncio.get_running_loop())
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="http-server")
        while not self._server.started:  # the listener is up within a loop turn or two
            if self._task.done():
                sock.close()
                self._task.result()  # raises what stopped it
                raise OSError(f"the HTTP server on {self._host}:{self.port} stopped at start")
            await asyncio.sleep(0.005)
        sock.listen(LISTEN_BACKLOG)  # (a second listen() sets the queue's length again)
        return self.port

    async def stop(self) -> None:
        """Close the listener and the connections (the runner has ended the requests first)."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), 5.0)
        except asyncio.TimeoutError:
            self._server.force_exit = True
            self._task.cancel()
        except BaseException:  # noqa: BLE001 - uvicorn's SystemExit on a failed start: already logged
            pass
        await asyncio.gather(self._task, return_exceptions=True)
        if self._restore_handler is not None:
            self._restore_handler()
