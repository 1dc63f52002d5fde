"""Who may call what, for both doors: bearer tokens (generation vs adapter management), TLS / mutual TLS files,
the HTTP door's Host names. The gRPC door enforces it in an interceptor (grpc_api/security.py), the HTTP door
per route (http_api/request_checks.py), both through `BearerAuth`, by the gRPC method a call stands for.

Policy (see docs/operations.md):
- health and reflection are always open (load balancers and grpcurl need them);
- Generation.* and Adapters.ListAdapters need `api_token` when it is set (the admin token works too);
- Adapters.LoadAdapter / UnloadAdapter are PERMISSION_DENIED when management is disabled; otherwise they
  need `admin_token`, or `api_token` when only that is set (management is never less protected than
  generation), or nothing when neither is set.
"""
from __future__ import annotations

import hmac
import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

import grpc

API_PREFIX = "/loraserve.v1."
ADMIN_METHODS = frozenset({"/loraserve.v1.Adapters/LoadAdapter", "/loraserve.v1.Adapters/UnloadAdapter"})


@dataclass(frozen=True)
class TlsConfig:
    cert_file: str                     # PEM certificate chain of the server
    key_file: str                      # PEM private key
    client_ca_file: str | None = None  # set: mutual TLS, clients need a certificate signed by this CA

    def server_credentials(self) -> grpc.ServerCredentials:
        key, cert = Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes()
        client_ca = Path(self.client_ca_file).read_bytes() if self.client_ca_file else None
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                           require_client_auth=client_ca is not None)


@dataclass(frozen=True)
class SecurityConfig:
    api_token: str | None = None     # bearer token for Generation.* and ListAdapters
    admin_token: str | None = None   # bearer token for LoadAdapter / UnloadAdapter
    disable_adapter_management: bool = False
    tls: TlsConfig | None = None
    # Host header names the HTTP door answers to (DNS rebinding): "*" any, "*.example.com" a domain; empty:
    # chosen from --host and --api-token (service/http_api/hosts.py). Stored normalised (host_pattern).
    allowed_hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("api_token", "admin_token"):
            token = getattr(self, name)
            if token is not None and (not token or token != token.strip() or not token.isprintable()):
                raise ValueError(f"{name} must be a non-empty printable string without surrounding spaces")
        object.__setattr__(self, "allowed_hosts", tuple(host_pattern(h) for h in self.allowed_hosts))

    def management_is_open(self) -> bool:
        return not self.disable_adapter_management and self.admin_token is None and self.api_token is None


_NAME = re.compile(r"(\*\.)?[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*")  # (_: container names)


def host_pattern(value: str) -> str:
    """An --allowed-hosts entry as Host headers are matched: lower case, IPv6 without brackets, no trailing dot.
    ValueError, saying why, for anything else (a port, a URL, a wildcard inside a name)."""
    host = value.strip().lower()
    if host == "*":
        return host
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        pass
    name = host.removesuffix(".")
    if not _NAME.fullmatch(name) or len(name) > 253:
        raise ValueError(f"allowed host {value!r} is not a host name, an IP address, '*.domain' or '*' (give names "
                         "without a scheme or port: any port is accepted)")
    return name


class BearerAuth:
    """The token policy above, for a call of `method` ("/loraserve.v1.Service/Method") with its metadata."""

    def __init__(self, config: SecurityConfig):
        self._config = config
        self._api = _tokens(config.api_token, config.admin_token) if config.api_token else None
        admin = config.admin_token or config.api_token
        self._admin = _tokens(admin) if admin else None

    def check(self, method: str, metadata) -> tuple[grpc.StatusCode, str] | None:
        """None when the call may go on, else the status and message that refuse it."""
        if method in ADMIN_METHODS:
            if self._config.disable_adapter_management:
                return (grpc.StatusCode.PERMISSION_DENIED,
                        "adapter management is disabled on this server (--disable-adapter-management)")
            accepted = self._admin
        else:
            accepted = self._api
        if accepted is None:
            return None
        header = next((v for k, v in metadata or () if k == "authorization"), None)
        if header is None:
            return (grpc.StatusCode.UNAUTHENTICATED,
                    "missing credentials: send metadata 'authorization: Bearer <token>'")
        if isinstance(header, bytes):
            header = header.decode("latin-1")
        scheme, _, token = header.partition(" ")
        # Compare with every accepted token, each in constant time, so timing says nothing about which.
        matches = [hmac.compare_digest(token.strip().encode(), t) for t in accepted]
        if scheme.lower() != "bearer" or not any(matches):
            kind = "adapter management" if method in ADMIN_METHODS else "this method"
            return grpc.StatusCode.UNAUTHENTICATED, f"invalid bearer token for {kind}"
        return None


def _tokens(*tokens: str | None) -> tuple[bytes, ...]:
    return tuple(t.encode() for t in tokens if t)
