"""The grpc.health.v1 check for HAProxy, as raw HTTP/2 bytes: `python -m service.tools.haproxy_check`.

HAProxy's `http-check send` cannot carry a gRPC request body (the 5-byte message prefix holds NUL bytes, which
its configuration strings end at), so the check is a `tcp-check` that speaks HTTP/2 itself: the client preface,
an empty SETTINGS frame, one HEADERS frame (POST /grpc.health.v1.Health/Check, HPACK literals, no Huffman) and
one DATA frame with an empty HealthCheckRequest (service "": the whole server). It passes when the answer holds
the gRPC message of HealthCheckResponse{status: SERVING}; NOT_SERVING (warming up, draining) or no answer fails.
deploy/haproxy/haproxy.cfg carries the output; tests/test_scaleout_config.py checks that they agree.
"""
from __future__ import annotations

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEALTH_PATH = "/grpc.health.v1.Health/Check"
# HPACK static table indices (RFC 7541, appendix A)
_METHOD_POST, _SCHEME_HTTP, _PATH, _AUTHORITY, _CONTENT_TYPE = 3, 6, 4, 1, 31
_DATA, _HEADERS, _SETTINGS = 0x0, 0x1, 0x4
_END_STREAM, _END_HEADERS = 0x1, 0x4


def _literal(name: int | str, value: str) -> bytes:
    """A header field "literal without indexing" (RFC 7541 6.2.2), name by index or new; lengths < 127."""
    if isinstance(name, int):
        head = bytes([name]) if name < 15 else bytes([0x0F, name - 15])
    else:
        head = bytes([0x00, len(name)]) + name.encode()
    return head + bytes([len(value)]) + value.encode()


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def grpc_message(payload: bytes) -> bytes:
    """gRPC length-prefixed message: uncompressed flag, 4-byte big-endian length, the protobuf bytes."""
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


def check_request(authority: str = "lb") -> bytes:
    headers = (bytes([0x80 | _METHOD_POST, 0x80 | _SCHEME_HTTP]) + _literal(_PATH, HEALTH_PATH)
               + _literal(_AUTHORITY, authority) + _literal(_CONTENT_TYPE, "application/grpc")
               + _literal("te", "trailers"))
    return (PREFACE + _frame(_SETTINGS, 0, 0, b"") + _frame(_HEADERS, _END_HEADERS, 1, headers)
            + _frame(_DATA, _END_STREAM, 1, grpc_message(b"")))


def serving_response() -> bytes:
    """What a SERVING answer's DATA frame carries: HealthCheckResponse{status: SERVING (1)} (field 1, varint)."""
    return grpc_message(bytes([0x08, 0x01]))


def any_status_pattern() -> str:
    """A regex over the answer's hex: a HealthCheckResponse with any status (SERVING, NOT_SERVING, UNKNOWN...)."""
    return serving_response().hex()[:-2] + "0[0-3]"


def tcp_check_lines() -> list[str]:
    # First wait for an answer, whatever its status; then require SERVING. A NOT_SERVING answer then fails at
    # once (min-recv: what has arrived is conclusive), where "expect SERVING" alone would wait for more bytes
    # until the check timeout.
    return ["option tcp-check", "tcp-check connect", f"tcp-check send-binary {check_request().hex()}",
            f"tcp-check expect rbinary {any_status_pattern()}",
            f"tcp-check expect min-recv 1 binary {serving_response().hex()}"]


if __name__ == "__main__":
    print("\n".join(tcp_check_lines()))
