"""The client: the SDK (sync and asyncio) and `lora-client`. It imports nothing of the server's, and no torch."""
from service.client.channel import ClientTLS
from service.client.errors import (
                                   CancelledError,
                                   DeadlineExceededError,
                                   FailedPreconditionError,
                                   FieldViolation,
                                   InternalError,
                                   InvalidArgumentError,
                                   LoraServeError,
                                   NotFoundError,
                                   PermissionDeniedError,
                                   ResourceExhaustedError,
                                   UnauthenticatedError,
                                   UnavailableError,
                                   from_rpc_error,
)
from service.client.sdk import (
                                   AdapterInfo,
                                   AsyncLoraServeClient,
                                   Completion,
                                   GenerateChunk,
                                   LoraServeClient,
                                   ModelInfo,
                                   Usage,
)

__all__ = [
    "AdapterInfo", "AsyncLoraServeClient", "CancelledError", "ClientTLS", "Completion", "DeadlineExceededError",
    "FailedPreconditionError", "FieldViolation", "GenerateChunk", "InternalError", "InvalidArgumentError",
    "LoraServeClient", "LoraServeError", "ModelInfo", "NotFoundError", "PermissionDeniedError",
    "ResourceExhaustedError", "UnauthenticatedError", "UnavailableError", "Usage", "from_rpc_error",
]
