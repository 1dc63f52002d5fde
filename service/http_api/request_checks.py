"""What the HTTP door's authenticated routes check before any work: the bearer token (the gRPC door's policy,
by the gRPC method the route stands for), a body declared JSON, and the body's size."""
from __future__ import annotations

import email.message

import grpc
from fastapi import Request

from service.http_api.errors import HTTP_STATUS, HttpError
from service.security import BearerAuth


def authorize(auth: BearerAuth, request: Request, method: str) -> None:
    """HttpError 401 (no or a wrong token) or 403 (adapter management disabled) unless the request may call
    `method` ("/loraserve.v1.Service/Method": the same policy on both doors)."""
    header = request.headers.get("authorization")
    refusal = auth.check(method, [("authorization", header)] if header is not None else [])
    if refusal is not None:
        code, message = refusal
        if code is grpc.StatusCode.UNAUTHENTICATED and header is None:
            message = "missing credentials: send the header 'Authorization: Bearer <token>'"
        raise HttpError(HTTP_STATUS[code], code, message)


def require_json(content_type: str | None) -> None:
    """415 unless the body is declared JSON (application/json or application/*+json, UTF-8), as FastAPI reads
    bodies, except that a missing Content-Type is refused too: a page on another origin can POST text/plain, a
    form or an untyped body without the browser asking first, and a JSON type needs that permission."""
    message = email.message.Message()
    message["content-type"] = content_type or ""
    subtype = message.get_content_subtype()
    charset = message.get_content_charset() or "utf-8"
    if (content_type and message.get_content_maintype() == "application" and (subtype == "json" or
            subtype.endswith("+json")) and charset.replace("-", "") == "utf8"):
        return
    got = f"Content-Type {content_type[:100]!r}" if content_type else "no Content-Type"
    raise HttpError(415, grpc.StatusCode.INVALID_ARGUMENT,
                    f"the request body must be JSON: send the header 'Content-Type: application/json' (got {got})")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to exceed `limit` bytes (--max-message-bytes)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(len(body), limit)
    return bytes(body)


def _too_large(size: int, limit: int) -> HttpError:
    return HttpError(413, grpc.StatusCode.RESOURCE_EXHAUSTED,
                     f"the request body has {size} bytes; this server accepts at most {limit} (--max-message-bytes)")
