"""Service errors and the one mapping from any exception to a gRPC status with google.rpc details.

Handlers raise; `to_rpc_status` (used by the interceptor) decides the code, message and details.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from lora_compile import errors as engine_errors

log = logging.getLogger(__name__)

# The engine's adapter errors, as the doors see them: a door imports no engine module (tests/test_import_rules.py).
AdapterError = engine_errors.AdapterError
AdapterNameError = engine_errors.AdapterNameError
AdapterPathError = engine_errors.AdapterPathError


@dataclass(frozen=True)
class FieldViolation:
    field: str  # proto field path, e.g. "sampling.temperature" or "token_ids.ids[3]"
    description: str


class ServiceError(Exception):
    """An error with a definite status code; the message is sent to the client as is."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def details(self) -> list:
        return []


MAX_REPORTED_VIOLATIONS = 16  # beyond this, one summary entry: status details travel in (size-limited) trailers


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, violations: list[FieldViolation]):
        violations = list(violations)
        if len(violations) > MAX_REPORTED_VIOLATIONS:
            rest = len(violations) - MAX_REPORTED_VIOLATIONS + 1
            violations = violations[:MAX_REPORTED_VIOLATIONS - 1] + [
                FieldViolation("(more)", f"{rest} more problems not listed")]
        self.violations = violations
        super().__init__("; ".join(f"{v.field}: {v.description}" for v in self.violations))

    def details(self) -> list:
        return [error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
            for v in self.violations
        ])]


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND

    def __init__(self, resource_type: str, name: str, message: str | None = None):
        self.resource_type, self.name = resource_type, name
        super().__init__(message or f"{resource_type} {name!r} is not loaded")

    def details(self) -> list:
        return [error_details_pb2.ResourceInfo(resource_type=self.resource_type, resource_name=self.name)]


class QueueFull(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, waiting: int, retry_after_s: float, needed: int = 1, left: int = 0):
        """`needed`: the sequences of the request (its choices), of which only `left` fit now."""
        self.retry_after_s = retry_after_s
        more = f"; the {needed} choices of this request need {needed} places, {left} are left" if needed > 1 else ""
        super().__init__(f"the waiting queue is full ({waiting} requests{more}); retry in {retry_after_s:g}s")

    def details(self) -> list:
        return [_retry_info(self.retry_after_s)]


def _retry_info(seconds: float) -> error_details_pb2.RetryInfo:
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(int(seconds * 1e9))
    return error_details_pb2.RetryInfo(retry_delay=delay)


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class MalformedRequest(ServiceError):
    """The request bytes do not parse as the method's message (bad wire format, or a string field that is
    not valid UTF-8: protobuf refuses those at parse time, before any handler runs)."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, message_type: str, reason: str):
        super().__init__(f"the request does not parse as a {message_type} message: {reason}")


class TooManyStreams(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, limit: int, retry_after_s: float):
        self.retry_after_s = retry_after_s
        super().__init__(f"too many open Generate streams (limit {limit}); retry in {retry_after_s:g}s")

    def details(self) -> list:
        return [_retry_info(self.retry_after_s)]


class StreamStalled(ServiceError):
    """The request finished, but its client left the output unread for --stall-timeout."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, seconds: float):
        super().__init__(f"the client did not read its finished stream for {seconds:g}s; the stream was ended "
                         "(read the stream as it arrives)")


class EngineFailure(ServiceError):
    """The engine raised inside a step; only that step's requests fail."""

    code = grpc.StatusCode.INTERNAL


def _classify(exc: BaseException) -> tuple[grpc.StatusCode, str, list]:
    if isinstance(exc, ServiceError):
        return exc.code, str(exc), exc.details()
    if isinstance(exc, engine_errors.AdapterNotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(exc), []
    if isinstance(exc, engine_errors.AdapterInUseError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc), []
    if isinstance(exc, engine_errors.AdapterNameError):
        return (grpc.StatusCode.INVALID_ARGUMENT, str(exc),
                InvalidArgument([FieldViolation("adapter", str(exc))]).details())
    if isinstance(exc, engine_errors.AdapterPathError):  # the argument itself is not allowed
        return (grpc.StatusCode.INVALID_ARGUMENT, str(exc),
                InvalidArgument([FieldViolation("path", str(exc))]).details())
    if isinstance(exc, engine_errors.AdapterError):  # the files on the server are not a usable adapter
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc), []
    log.error("internal error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}", []


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str, list]:
    """(status code, message, google.rpc details) of any exception: the one mapping, for both front doors."""
    return _classify(exc)


def to_rpc_status(exc: BaseException) -> grpc.Status:
    code, message, details = _classify(exc)
    packed = []
    for detail in details:
        any_msg = any_pb2.Any()
        any_msg.Pack(detail)
        packed.append(any_msg)
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=message, details=packed)
    return rpc_status.to_status(status)
