"""Typed requests and outputs between the servicer and the scheduler (no protobuf, no tensors), and the
lifecycle events the scheduler stamps on a request for whoever reports on it (telemetry)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from lora_compile import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    """A validated Generate call."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    adapter: str | None = None            # None: the base model
    stop: tuple[str, ...] = ()
    n: int = 1                            # choices sampled from the one prompt
    # The structured output's field in the door's own words (GenerateParams.names): where a step's refusal points.
    structured_output_field: str = "structured_output"
    adapters_field: str = "adapters"      # the same for a mix of adapters (a mix its members cannot make)


@dataclass(frozen=True)
class ModelInfo:
    """What the service may know of the model and the engine's limits (the runner fills it)."""

    model: str
    architecture: str
    vocab_size: int          # ids the model and the tokenizer both know
    max_seq_len: int
    max_num_seqs: int        # sequences running at once (max_batch_size: its old name)
    max_loras_per_batch: int
    max_lora_rank: int
    dtype: str
    device: str
    compiled: bool
    eos_token_ids: tuple[int, ...]
    max_token_chars: int     # the tokenizer's longest token, in characters (bounds a text prompt's length)
    max_cpu_lora_bytes: int = 0       # host cache of adapters
    on_demand_adapters: bool = False  # adapter directories are set
    num_kv_blocks: int = 0            # the paged KV cache: usable blocks of block_size tokens
    block_size: int = 0
    prefix_caching: bool = False
    # Every name the base model answers to as a request's model (--served-model-name; `model` is the first).
    served_model_names: tuple[str, ...] = ()

    def is_base_model(self, name: str) -> bool:
        """An empty name, or one the base model is served under."""
        return name == "" or name in (self.served_model_names or (self.model,))

    @property
    def max_batch_size(self) -> int:
        return self.max_num_seqs

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size


@dataclass
class RequestOutput:
    """What one engine step added to one request; the last one has finish_reason set."""

    index: int = 0                    # which choice (prompt_index * n + i; service.runner.parent_request)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None  # "length", "stop", "eos", "grammar" or "cancelled"
    stop: str | None = None           # the matched stop string
    stop_token_id: int | None = None  # the matched stop token
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0            # prompt tokens served from the prefix cache (set with finish_reason)
    # With SamplingParams.prompt_logprobs (echo), on the request's first output only: entry i is prompt token i + 1's
    # log-probability given the tokens before it (the first prompt token has none), and the top prompt_logprobs
    # (token id, log-probability) pairs at that position, best first.
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, later: RequestOutput) -> None:
        """Append a later output (its reader had not taken this one yet): one response carries both."""
        self.text += later.text
        self.token_ids += later.token_ids
        self.logprobs += later.logprobs
        self.top_logprobs += later.top_logprobs
        self.prompt_logprobs += later.prompt_logprobs  # (only a first output has them)
        self.prompt_top_logprobs += later.prompt_top_logprobs
        for name in ("finish_reason", "stop", "stop_token_id", "prompt_tokens", "completion_tokens", "cached_tokens"):
            setattr(self, name, getattr(later, name))


class RequestEventType(enum.Enum):
    """vLLM v1's EngineCoreEventType, for one request's life in the runner."""

    QUEUED = "queued"            # add_request
    # fields: start_ns (admission began), adapter_loaded (copied into a device slot); when it waited for its
    # adapter's disk read: adapter_wait_start_ns (when it began waiting), adapter_read (the read's start, end)
    ADMITTED = "admitted"
    FIRST_TOKEN = "first_token"  # at the end of the step that sampled it
    # fields: finish_reason, prompt_tokens, completion_tokens, cached_tokens; or error (the exception)
    FINISHED = "finished"
    ABORTED = "aborted"          # the client went away before the last output (cancel, deadline, closed stream)


class RequestEvent(NamedTuple):
    type: RequestEventType
    time_ns: int  # wall clock (time.time_ns), as span timestamps are
    fields: dict[str, Any] | None = None
