"""Any exception → OpenAI's error body `{"error": {"message", "type", "param", "code"}}` with the HTTP status of
the gRPC status the same mistake gets (service/errors.py decides the status for both doors)."""
from __future__ import annotations

import grpc
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from service.errors import ServiceError, status_of

# gRPC status → HTTP status (the mapping of google.api's HttpRule / grpc-gateway).
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.DATA_LOSS: 500,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# OpenAI's error types, by HTTP status.
_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
               415: "invalid_request_error", 421: "invalid_request_error", 429: "rate_limit_error",
               431: "invalid_request_error", 503: "service_unavailable_error"}


class HttpError(ServiceError):
    """A mistake only HTTP can make (a body too large or not declared JSON), with its own HTTP status."""

    def __init__(self, status: int, code: grpc.StatusCode, message: str, param: str | None = None):
        self.status, self.code, self.param = status, code, param
        super().__init__(message)


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPE.get(status, "server_error"), "param": param,
                      "code": code}}


def classify(exc: BaseException) -> tuple[int, dict, dict[str, str]]:
    """(HTTP status, OpenAI error body, extra headers) for an exception raised while serving a request."""
    headers: dict[str, str] = {}
    if isinstance(exc, ValidationError):  # the body's types or ranges (pydantic)
        problems = [(_loc(e["loc"]), e["msg"]) for e in exc.errors(include_url=False)]
        message = "; ".join(f"{loc}: {msg}" if loc else msg for loc, msg in problems[:16])
        return 400, error_body(400, message, "invalid_argument", problems[0][0] or None), headers
    if isinstance(exc, HttpError):
        return exc.status, error_body(exc.status, str(exc), exc.code.name.lower(), exc.param), headers
    code, message, _ = status_of(exc)
    status = HTTP_STATUS.get(code, 500)
    param = None
    violations = getattr(exc, "violations", None)
    if violations:
        param = violations[0].field
    retry = getattr(exc, "retry_after_s", None)
    if retry is not None:
        headers["retry-after"] = str(max(1, round(retry)))  # (whole seconds in HTTP)
    return status, error_body(status, message, code.name.lower(), param), headers


def error_response(exc: BaseException) -> JSONResponse:
    status, body, headers = classify(exc)
    return JSONResponse(body, status_code=status, headers=headers)


def grpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status the same mistake gets (a call's span records it)."""
    if isinstance(exc, (ValidationError, RequestValidationError)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, HttpError):
        return exc.code, str(exc)
    code, message, _ = status_of(exc)
    return code, message


def _loc(loc: tuple) -> str:
    """pydantic's location → a dotted parameter path (`messages[0].content`); the union arm names are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "int", "list[int]", "list[str]", "list[list[int]]", "float", "bool", "dict[str,any]",
                      "list[dict[str,any]]", "constrained-int", "function-after", "json-or-python[json=int,python=int]"):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out
