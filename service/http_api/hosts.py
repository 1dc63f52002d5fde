"""Which Host headers the HTTP door answers to: a guard against DNS rebinding, where a web page on another origin
gets a name of its own resolved to this server's address and then calls the server as a same-origin page.

The names come from `--allowed-hosts` when given; else, when `--api-token` is set, any (the token is the guard);
else from `--host`: the loopback names for a loopback address, that address for another one, any for a wildcard
(0.0.0.0, ::), where the server is meant to be reached by whatever name its clients use. /health (/ping) and /metrics
answer any Host: probes and scrapers reach a pod by its IP, and both are open without a token anyway.
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from service.http_api.errors import error_body
from service.security import SecurityConfig, host_pattern

ANY = "*"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_BINDS = ("", "0.0.0.0", "::")
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics"})  # (/ping: /health under vLLM's other name)
MISDIRECTED = 421  # RFC 9110: the request went to a server that does not answer for that name
_HOST_HEADER = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[^:\[\]@/\s*]+)(:\d{1,5})?")


@dataclass(frozen=True)
class HostPolicy:
    allowed: tuple[str, ...]  # host_pattern()s; ("*",): any Host
    source: str = ""          # where the names come from, for the refusal

    @classmethod
    def for_server(cls, security: SecurityConfig, bind_host: str) -> HostPolicy:
        if security.allowed_hosts:
            return cls(security.allowed_hosts, "--allowed-hosts")
        if security.api_token is not None:
            return cls((ANY,))
        bind = bind_host.strip().strip("[]")
        if bind in WILDCARD_BINDS:
            return cls((ANY,))
        names = (host_pattern(bind),)
        if bind == "localhost" or _is_loopback(bind):
            names = tuple(dict.fromkeys((*LOOPBACK_NAMES, *names)))
        return cls(names, f"it listens on {bind_host} and has no --api-token")

    @property
    def allows_any(self) -> bool:
        return ANY in self.allowed

    def allows(self, header: str | None) -> bool:
        if self.allows_any:
            return True
        host = _host_of(header)
        return host is not None and any(
            host == p or (p.startswith("*.") and host.endswith(p[1:])) for p in self.allowed)

    def refusal(self, header: str | None) -> str:
        got = "a request without a Host header" if header is None else f"Host {header[:100]!r}"
        names = ", ".join(f"[{p}]" if ":" in p else p for p in self.allowed)
        name = _host_of(header) or "NAME"
        fix = (f"add {name} to --allowed-hosts" if self.source == "--allowed-hosts"
               else f"start it with --allowed-hosts {name} (or --api-token)")
        return (f"this server does not answer to {got}: it answers only to {names} ({self.source}: a guard "
                f"against DNS rebinding); call it by one of those names, or {fix}")


class HostCheck:
    """ASGI middleware: 421 with an OpenAI error body for a Host the policy refuses, before any route runs."""

    def __init__(self, app, policy: HostPolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            header = Headers(scope=scope).get("host")
            if not self.policy.allows(header):
                body = error_body(MISDIRECTED, self.policy.refusal(header), "misdirected_request")
                return await JSONResponse(body, status_code=MISDIRECTED)(scope, receive, send)
        return await self.app(scope, receive, send)


def _host_of(header: str | None) -> str | None:
    """The Host header's name as host_pattern writes it (no port), or None when it is not a plain host[:port]."""
    match = _HOST_HEADER.fullmatch(header or "")
    if match is None:
        return None
    try:
        return host_pattern(match["host"])
    except ValueError:
        return None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
