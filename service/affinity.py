"""The wire names a load balancer routes on, shared by the server, the SDK and the CLI (no torch, no grpc).

`x-adapter-id` (gRPC metadata key / HTTP header): the adapter a request is for, so a proxy can hash on it
(HAProxy `balance hdr(x-adapter-id)` + `hash-type consistent`) without parsing bodies; each adapter then
stays warm on few replicas. Empty, or the base model's name: the base model.
`x-replica-id`: which replica answered (gRPC initial metadata of every Generate; HTTP response header).
"""
from __future__ import annotations

ADAPTER_ID_HEADER = "x-adapter-id"
REPLICA_ID_HEADER = "x-replica-id"


def adapter_header_value(adapter: str | None) -> str | None:
    """The header a client sends for `adapter` (None or "": the base model); None (send no header) for a name
    that is no legal header value (printable ASCII only, in gRPC metadata and HTTP alike): the server then
    judges the name itself, and the balancer routes the request as one without the header."""
    value = adapter or ""
    return value if all(" " <= c <= "~" for c in value) else None


def adapter_header_problem(header: str | None, adapter: str | None, base_models: tuple[str, ...],
                           field: str) -> str | None:
    """Why `header` (None: not sent) disagrees with the request's adapter (`field`: its name in the request,
    None or "": the base model), or None when it agrees. `base_models`: the names the base model is served under.
    A disagreement means a misrouted or mislabelled request: the proxy picked the replica from the header, the
    server would serve the body's adapter."""
    if header is None:
        return None
    wanted = None if header == "" or header in base_models else header
    if wanted == (adapter or None):
        return None
    return (f"the {ADAPTER_ID_HEADER} header says {header!r} but {field} is {adapter or ''!r}; send the same "
            f"adapter in both (an empty header or {base_models[0]!r} means the base model)")
