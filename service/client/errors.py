"""Typed SDK errors: one LoraServeError subclass per status code, with the google.rpc details unpacked."""
from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2, status_pb2

_DETAILS_KEY = "grpc-status-details-bin"
_DETAIL_TYPES = (error_details_pb2.BadRequest, error_details_pb2.RetryInfo, error_details_pb2.ResourceInfo,
                 error_details_pb2.ErrorInfo, error_details_pb2.PreconditionFailure)


@dataclass(frozen=True)
class FieldViolation:
    field: str
    description: str


class LoraServeError(Exception):
    """An RPC failed. `.code` is the grpc.StatusCode, `.details` the unpacked google.rpc detail messages."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None, details: list | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.details = details or []

    @property
    def field_violations(self) -> list[FieldViolation]:
        return [FieldViolation(v.field, v.description)
                for d in self.details if isinstance(d, error_details_pb2.BadRequest) for v in d.field_violations]

    @property
    def retry_delay(self) -> float | None:
        """Seconds the server asks to wait before retrying (RESOURCE_EXHAUSTED), if it said."""
        for d in self.details:
            if isinstance(d, error_details_pb2.RetryInfo):
                return d.retry_delay.ToNanoseconds() / 1e9
        return None

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class InvalidArgumentError(LoraServeError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(LoraServeError):
    code = grpc.StatusCode.NOT_FOUND


class ResourceExhaustedError(LoraServeError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPreconditionError(LoraServeError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class UnavailableError(LoraServeError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(LoraServeError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class CancelledError(LoraServeError):
    code = grpc.StatusCode.CANCELLED


class InternalError(LoraServeError):
    code = grpc.StatusCode.INTERNAL


class UnauthenticatedError(LoraServeError):
    """No bearer token, or a wrong one (see --api-token / --admin-token)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(LoraServeError):
    """Not allowed on this server, whatever the token (e.g. --disable-adapter-management)."""

    code = grpc.StatusCode.PERMISSION_DENIED


_BY_CODE = {cls.code: cls for cls in (InvalidArgumentError, NotFoundError, ResourceExhaustedError,
                                      FailedPreconditionError, UnavailableError, DeadlineExceededError,
                                      CancelledError, InternalError, UnauthenticatedError, PermissionDeniedError)}


def _unpack(status: status_pb2.Status) -> list:
    out = []
    for any_msg in status.details:
        for cls in _DETAIL_TYPES:
            if any_msg.Is(cls.DESCRIPTOR):
                msg = cls()
                any_msg.Unpack(msg)
                out.append(msg)
                break
        else:
            out.append(any_msg)  # an unknown detail type: keep it packed
    return out


def from_rpc_error(error: grpc.RpcError) -> LoraServeError:
    """Works for sync (grpc.RpcError that is a grpc.Call) and asyncio (grpc.aio.AioRpcError) errors."""
    code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
    message = (error.details() if callable(getattr(error, "details", None)) else None) or str(error)
    details: list = []
    trailing = error.trailing_metadata() if callable(getattr(error, "trailing_metadata", None)) else None
    for key, value in trailing or ():
        if key == _DETAILS_KEY:
            details = _unpack(status_pb2.Status.FromString(value))
    return _BY_CODE.get(code, LoraServeError)(message, code, details)
