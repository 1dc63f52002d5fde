"""Connection limits for both doors: caps on open connections, idle / header / handshake timeouts, and the
file-handle budget they are derived from (flags of the same names; see docs/operations.md).

A connection holds a file handle. The process has RLIMIT_NOFILE of them, shared with model and adapter files,
logs, the telemetry exporter and the runtime's own descriptors; when connections take the last one, every accept
and every adapter read fails at once. So each door is capped below the limit (a reserve stays free), idle and
half-sent connections are closed, and an accept that fails anyway is logged once, never once per retry.
"""
from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

# Descriptors the process holds besides connections: measured 15 for a served demo model (sockets, epoll,
# eventfds, logs); model and adapter files, loader threads, compile workers and exporters add a few dozen.
MIN_FD_RESERVE = 64
MAX_FD_RESERVE = 1024
# The derived cap's ceiling, whatever the limit: an idle connection costs the server about 4.5 KiB (HTTP) and
# 18 KiB (gRPC) of memory besides its kernel buffers (measured with 3,000 of each), so a hard limit of 2**20
# must not turn into a million connections.
MAX_DERIVED_CONNECTIONS = 10_000
# asyncio's message for an accept() that failed for lack of descriptors or memory (EMFILE, ENFILE, ENOBUFS,
# ENOMEM); asyncio retries a second later, and its default handler logs a traceback for every failed accept.
ACCEPT_OUT_OF_RESOURCES = "socket.accept() out of system resource"


@dataclass(frozen=True)
class ConnectionLimits:
    """The one object of connection knobs: the CLI fills it, both doors read it."""

    # Open connections per door (HTTP, gRPC); None: derived from the file-handle limit (per_door()). Beyond it a
    # new connection is accepted and closed at once (HTTP: after a 503 with Connection: close).
    max_connections: int | None = None
    # HTTP: an idle connection (no request in progress, none started) is closed after this (uvicorn's
    # timeout_keep_alive). It also closes a new connection that never sends a byte.
    timeout_keep_alive_s: float = 5.0
    # HTTP: a request line and headers must arrive within this of their first byte (slowloris). gRPC: the
    # handshake (TLS, then the client's HTTP/2 preface and SETTINGS) must end within this of the accept.
    header_timeout_s: float = 10.0
    # HTTP: largest request line + headers (h11's max incomplete event size); over it: 431.
    h11_max_incomplete_event_size: int = 16 * 1024
    # gRPC: a connection without calls for this long gets GOAWAY (the client reconnects on its next call).
    grpc_max_connection_idle_s: float | None = 300.0
    # gRPC: a connection this old gets GOAWAY (clients reconnect, so they spread over replicas added since);
    # its calls in flight then have the grace to finish, after which they end with UNAVAILABLE. None: never.
    grpc_max_connection_age_s: float | None = 1800.0
    grpc_max_connection_age_grace_s: float = 600.0
    # gRPC: the server pings a connection quiet for this long and closes it if the ping is not answered within
    # the timeout (a client that vanished without closing its connection).
    grpc_keepalive_time_s: float = 60.0
    grpc_keepalive_timeout_s: float = 20.0

    def __post_init__(self) -> None:
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1 (or unset), got {self.max_connections}")
        for name in ("timeout_keep_alive_s", "header_timeout_s", "grpc_max_connection_age_grace_s",
                     "grpc_keepalive_time_s", "grpc_keepalive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("grpc_max_connection_idle_s", "grpc_max_connection_age_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 (or unset), got {value}")
        if self.h11_max_incomplete_event_size < 1024:
            raise ValueError(f"h11_max_incomplete_event_size must be >= 1024, got {self.h11_max_incomplete_event_size}")

    def per_door(self, doors: int) -> int:
        """The cap on one door's open connections: max_connections, or what the file-handle limit leaves."""
        if self.max_connections is not None:
            return self.max_connections
        limit = open_files_limit()
        return max(1, min(MAX_DERIVED_CONNECTIONS, (limit - fd_reserve(limit)) // max(1, doors)))

    def accept_batch(self) -> int:
        """How many connections the HTTP door accepts in one event-loop turn, before any of them is counted
        against the cap: a quarter of the reserve (at least 16, at most 2048), so a burst of connections cannot
        take the reserve."""
        return min(2048, max(16, fd_reserve(open_files_limit()) // 4))

    def grpc_options(self, doors: int) -> list[tuple[str, int]]:
        """grpc.aio server options (grpc core channel args)."""
        ms = lambda seconds: int(seconds * 1000)  # noqa: E731
        options = [
            # Excess connections are accepted and closed at once by grpc core (checked against grpcio 1.85).
            ("grpc.max_allowed_incoming_connections", self.per_door(doors)),
            # A connection that never sends its HTTP/2 preface and SETTINGS (or stalls its TLS handshake) gets
            # GOAWAY "Did not receive HTTP/2 settings before handshake timeout".
            ("grpc.server_handshake_timeout_ms", ms(self.header_timeout_s)),
            ("grpc.keepalive_time_ms", ms(self.grpc_keepalive_time_s)),
            ("grpc.keepalive_timeout_ms", ms(self.grpc_keepalive_timeout_s)),
            # Keepalive pings go on while a long stream sends nothing (a long prefill): grpc's default stops
            # sending pings after 2 without data, and so stops noticing a peer that is gone.
            ("grpc.http2.max_pings_without_data", 0),
        ]
        if self.grpc_max_connection_idle_s is not None:
            options.append(("grpc.max_connection_idle_ms", ms(self.grpc_max_connection_idle_s)))
        if self.grpc_max_connection_age_s is not None:
            options += [("grpc.max_connection_age_ms", ms(self.grpc_max_connection_age_s)),
                        ("grpc.max_connection_age_grace_ms", ms(self.grpc_max_connection_age_grace_s))]
        return options

    def overcommitted(self, doors: int) -> str | None:
        """Why an explicit max_connections can exhaust the file handles (None when it cannot)."""
        limit = open_files_limit()
        spare = limit - fd_reserve(limit)
        if self.max_connections is None or self.max_connections * doors <= spare:
            return None
        return (f"--max-connections {self.max_connections} on {doors} doors can hold "
                f"{self.max_connections * doors} file handles, but the file-handle limit {limit} leaves {spare} "
                f"beside the {fd_reserve(limit)} kept for files and logs: connections may take the last ones "
                "(raise the limit, ulimit -n, or lower --max-connections)")

    def describe(self, doors: int) -> str:
        limit = open_files_limit()
        http = (f"; HTTP keep-alive {self.timeout_keep_alive_s:g}s, request head {self.header_timeout_s:g}s"
                if doors > 1 else "")
        return (f"at most {self.per_door(doors)} open connections per door (file-handle limit {limit}, "
                f"{fd_reserve(limit)} kept for files and logs){http}")


def open_files_limit() -> int:
    """The soft RLIMIT_NOFILE (unlimited counts as 2**20)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


def fd_reserve(limit: int) -> int:
    """Descriptors kept free of connections: a quarter of the limit, at least 64 and at most 1024."""
    return min(MAX_FD_RESERVE, max(MIN_FD_RESERVE, limit // 4), limit // 2)


def raise_open_files_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit, as servers commonly do at start. Returns (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as e:  # e.g. a hard limit above the kernel's nr_open
            log.warning("cannot raise the file-handle limit from %d to %d: %s", soft, hard, e)
            return soft, soft
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class RateLimitedLog:
    """A warning logged once, then at most once per interval with how many times it happened meanwhile."""

    def __init__(self, logger: logging.Logger, interval_s: float = 60.0):
        self._log, self._interval = logger, interval_s
        self._last: float | None = None
        self._suppressed = 0

    def warning(self, message: str, *args) -> None:
        now = time.monotonic()
        if self._last is not None and now - self._last < self._interval:
            self._suppressed += 1
            return
        again = f" (and {self._suppressed} more times in the last {now - self._last:.0f}s)" if self._suppressed else ""
        self._log.warning(message + again, *args)
        self._last, self._suppressed = now, 0


def install_accept_error_handler(loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
    """Log accept() failures for lack of file handles once (then at most once a minute), without a traceback;
    everything else goes to the loop's handler as before. Returns a callable that restores that handler."""
    previous = loop.get_exception_handler()
    rate_limited = RateLimitedLog(log)

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if context.get("message") == ACCEPT_OUT_OF_RESOURCES:
            exc = context.get("exception")
            rate_limited.warning(
                "cannot accept HTTP connections: %s (file-handle limit %d); they wait in the listen backlog and "
                "are accepted again once handles are free; established connections are served",
                getattr(exc, "strerror", None) or exc, open_files_limit())
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
    return lambda: loop.set_exception_handler(previous)
