"""uvicorn's h11 protocol with the connection limits uvicorn lacks: a cap on open connections, a deadline for the
request head (slowloris) and one for its body (the same, from the head's end: 408), the keep-alive timeout from a
connection's start, and 431 for an over-size head.

Built on uvicorn's pure-Python h11 protocol, which the HTTP server pins (its default, `auto`, would pick
httptools where that is installed: another parser, without these hooks). Overridden: the asyncio protocol
callbacks and uvicorn's send_400_response; read: its `connections`, `conn`, `flow` and keep-alive timer.
Request handling is uvicorn's.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from service.connections import RateLimitedLog
from service.http_api.errors import error_body

log = logging.getLogger(__name__)


@dataclass
class DoorGuard:
    """What every connection of one HTTP door shares: its limits and its (rate-limited) log."""

    max_connections: int
    header_timeout_s: float
    max_head_bytes: int
    refusals: RateLimitedLog = field(default_factory=lambda: RateLimitedLog(log))
    slow_heads: RateLimitedLog = field(default_factory=lambda: RateLimitedLog(log))
    slow_bodies: RateLimitedLog = field(default_factory=lambda: RateLimitedLog(log))


def _response(status: int, reason: str, message: str, code: str, extra: str = "") -> bytes:
    body = json.dumps(error_body(status, message, code)).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{extra}connection: close\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    def __init__(self, *args, guard: DoorGuard, **kwargs):
        super().__init__(*args, **kwargs)
        self.guard = guard
        self._refused = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None  # after an error answer: the rest is read and dropped

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.guard.max_connections:
            self._refuse(transport)
            return
        super().connection_made(transport)
        # Idle from the start: uvicorn arms the keep-alive timer only after a response, so a connection that
        # never sent a byte stayed open for good.
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def _refuse(self, transport: asyncio.Transport) -> None:
        """Over the cap: answer 503 and close at once, so the refusal frees its file handle now."""
        self._refused, self.transport = True, transport
        self.guard.refusals.warning(
            "HTTP door: %d connections open (--max-connections); refusing new ones (503) until some close",
            len(self.connections))
        transport.write(_response(
            503, "Service Unavailable", f"this server has {len(self.connections)} HTTP connections open, its limit "
            "(--max-connections); retry shortly, or reuse a connection", "unavailable", "retry-after: 1\r\n"))
        transport.close()

    def data_received(self, data: bytes) -> None:
        if self._refused or self._linger_timer is not None:
            return  # dropped: the connection is closing
        super().data_received(data)
        # A request head started and not complete yet: it has header_timeout_s from its first byte (uvicorn has
        # no such deadline, so a head sent a byte at a time kept the connection for good).
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if waiting and self._head_timer is None:
            self._head_timer = self.loop.call_later(self.guard.header_timeout_s, self._head_timed_out)
        elif not waiting:
            self._cancel_head_timer()
        # Its body, likewise, has header_timeout_s from the head's end (a body sent a byte at a time held the
        # connection and its handler for good).
        sending = self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing()
        if sending and self._body_timer is None:
            self._body_timer = self.loop.call_later(self.guard.header_timeout_s, self._body_timed_out)
        elif not sending:
            self._cancel_body_timer()

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.guard.slow_heads.warning("HTTP door: closed a connection whose request head did not arrive within "
                                          "%gs (--header-timeout)", self.guard.header_timeout_s)
            self.transport.close()

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self.guard.slow_bodies.warning("HTTP door: closed a connection whose request body did not arrive within "
                                          "%gs of its head (--header-timeout)", self.guard.header_timeout_s)
            self.transport.write(_response(
                408, "Request Timeout", f"the request body did not arrive within {self.guard.header_timeout_s:g}s "
                "of its headers (this server's --header-timeout); send the whole request at once", "timeout"))
            self.transport.close()

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def send_400_response(self, msg: str) -> None:
        """uvicorn calls this when h11 refuses what the client sent: answer in JSON, 431 when the head is too
        large, then read and drop the rest for a while before closing (closing with unread input resets the
        connection, and the client would never read the answer)."""
        self._cancel_head_timer()
        if len(self.conn.trailing_data[0]) > self.guard.max_head_bytes:  # h11's own test for its 431 hint
            self.transport.write(_response(
                431, "Request Header Fields Too Large", f"the request line and headers are over "
                f"{self.guard.max_head_bytes} bytes, this server's limit (--h11-max-incomplete-event-size); "
                "send fewer or smaller headers", "invalid_argument"))
        else:
            self.transport.write(_response(400, "Bad Request", "the request is not valid HTTP/1.1", "invalid_argument"))
        if not self.transport.can_write_eof():  # TLS: no half-close
            self.transport.close()
            return
        self.transport.write_eof()
        self._linger_timer = self.loop.call_later(self.guard.header_timeout_s, self.transport.close)
        self.flow.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._cancel_body_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)
