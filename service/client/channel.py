"""Client-side connection security: TLS (optionally with a client certificate) and bearer tokens."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
from opentelemetry import propagate

# Where the server and the client CLI read tokens from, when no flag gives one (defined here: the client
# imports nothing of the server's, so it needs no torch).
API_TOKEN_ENV = "LORA_SERVE_API_TOKEN"
ADMIN_TOKEN_ENV = "LORA_SERVE_ADMIN_TOKEN"


@dataclass(frozen=True)
class ClientTLS:
    """TLS to the server. No root certificates: the system's trust store. A key and certificate chain:
    mutual TLS (the server was started with --tls-client-ca)."""

    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None
    server_name: str | None = None  # the name to check the server's certificate against, if not the target's

    @classmethod
    def from_files(cls, ca: str | None = None, cert: str | None = None, key: str | None = None,
                   server_name: str | None = None) -> ClientTLS:
        if (cert is None) != (key is None):
            raise ValueError("a client certificate needs its key, and the other way round")

        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None
        return cls(read(ca), read(key), read(cert), server_name)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def open_channel(target: str, tls: ClientTLS | None, options: Sequence[tuple] = (), *, aio: bool = False):
    """A grpc (or grpc.aio) channel: plaintext without `tls`, else TLS with its credentials."""
    module = grpc.aio if aio else grpc
    if tls is None:
        return module.insecure_channel(target, options=list(options))
    return module.secure_channel(target, tls.credentials(), options=[*options, *tls.options()])


def with_trace_context(metadata: tuple[tuple[str, str], ...] | None) -> tuple[tuple[str, str], ...] | None:
    """`metadata` plus the caller's W3C trace context (`traceparent`) when an OpenTelemetry span is current, so
    the server's spans join the caller's trace. Without a current span nothing is added."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    if not carrier:
        return metadata
    return (*(metadata or ()), *carrier.items())


def bearer(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """Call metadata carrying `token` (None: no metadata)."""
    return (("authorization", f"Bearer {token}"),) if token else None
