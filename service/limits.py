"""Operator limits on requests and streams (flags of the same names; see docs/operations.md).

All of them are checked before a request gets any work: a request over a limit is refused at once
(INVALID_ARGUMENT for the request's own fields, RESOURCE_EXHAUSTED for server capacity).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_MAX_MESSAGE_BYTES = 1 << 20  # a 1 MiB request holds far more prompt than any context here

# Fixed bounds on a Generate call's fields (both doors; prepare.py checks them).
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_STOP_CHARS = 256  # per stop string: longer ones would hold back that much text
MAX_NAME_CHARS = 256  # request_id (echoed in every response) and adapter (echoed in NOT_FOUND)
MAX_REPORTED_BAD_IDS = 8  # per repeated field: enough to fix the request, small enough for a status
MAX_TOP_LOGPROBS = 20
MAX_STRUCTURED_OUTPUT_CHARS = 64 * 1024  # a JSON schema, regex, choice list or grammar


@dataclass(frozen=True)
class RequestLimits:
    """The one object of operator limits: the CLI fills it, the runner, the request front and the doors read it."""

    max_queue: int = 256                       # requests waiting beyond a full batch before RESOURCE_EXHAUSTED
    retry_after_s: float = 1.0                 # RetryInfo sent with RESOURCE_EXHAUSTED
    max_prompt_tokens: int | None = None       # None: max_seq_len - 1
    max_new_tokens: int | None = None          # None: the rest of the context (max_seq_len - prompt)
    max_concurrent_streams: int | None = None  # open Generate streams; None: max_num_seqs + max_queue
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # largest request message (grpc.max_receive_message_length)
    # HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS per client connection; None: no per-connection cap (the server-wide
    # max_concurrent_streams answers with RESOURCE_EXHAUSTED + RetryInfo, which grpc's transport refusal cannot)
    max_streams_per_connection: int | None = None
    stall_timeout_s: float = 60.0              # a finished stream's output waits this long for its reader
    # Requests admitted past one that waits for a device slot (their adapters already hold slots) before admission
    # holds for it (docs/architecture.md, adapter-aware admission).
    max_overtakes: int = 16
    # One call's choices (a prompt list, n) in flight at once: at most this share of the running sequences and of
    # the places in flight (running + queue); the rest wait in the call's own backlog and follow as these finish.
    max_request_share: float = 0.25

    def request_caps(self, max_num_seqs: int) -> tuple[int, int]:
        """(running, in flight) choices one call may hold at once, each at least 1."""
        share = self.max_request_share
        return max(1, math.ceil(share * max_num_seqs)), max(1, math.ceil(share * (max_num_seqs + self.max_queue)))

    def __post_init__(self) -> None:
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.retry_after_s <= 0:
            raise ValueError(f"retry_after_s must be > 0, got {self.retry_after_s}")
        for name in ("max_prompt_tokens", "max_new_tokens", "max_concurrent_streams"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or unset), got {value}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if self.max_streams_per_connection is not None and self.max_streams_per_connection < 1:
            raise ValueError(f"max_streams_per_connection must be >= 1, got {self.max_streams_per_connection}")
        if self.max_overtakes < 0:
            raise ValueError(f"max_overtakes must be >= 0, got {self.max_overtakes}")
        if not 0 < self.max_request_share <= 1:
            raise ValueError(f"max_request_share must be in (0, 1], got {self.max_request_share}")
        if self.stall_timeout_s <= 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {self.stall_timeout_s}")
