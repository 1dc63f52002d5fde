"""OpenAI request bodies (pydantic, strict types) for /v1/completions and /v1/chat/completions.

Only the wire types and the ranges the shared request message can hold are checked here; what the values mean
(sampling rules, prompt and token limits) is checked once, by service.grpc_api.validation, for both doors
(see convert.py). Fields of OpenAI's API that lora-serve does not implement are accepted only at their neutral
value, so a request never silently gets something other than what it asked for.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

U32 = Annotated[StrictInt, Field(ge=0, le=2**32 - 1)]
I32 = Annotated[StrictInt, Field(ge=-(2**31), le=2**31 - 1)]
U64 = Annotated[StrictInt, Field(ge=0, le=2**64 - 1)]
Number = Annotated[float, Field(strict=True)]  # (strict float accepts JSON integers too)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: StrictBool = False


class _Common(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored (as OpenAI and vLLM do)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: StrictStr = ""
    max_tokens: U32 | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: I32 | None = None
    seed: U64 | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    repetition_penalty: Number | None = None
    user: StrictStr | None = None  # accepted and ignored (OpenAI's abuse-monitoring id)
    return_token_ids: StrictBool = False  # vLLM's extension: each choice also carries its token ids
    # Not implemented: accepted at their neutral value only (convert.unsupported_fields).
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    logit_bias: dict[str, Any] | None = None

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Common):
    prompt: StrictStr | list[U32] | list[StrictStr] | list[list[U32]]
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None  # top-k per position, as OpenAI's legacy API
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None
    max_tokens: U32 | None = 16  # OpenAI's default for completions


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # (tool calls, names... reach the template as given)
    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    max_completion_tokens: U32 | None = None  # OpenAI's newer name for max_tokens
    add_generation_prompt: StrictBool = True  # vLLM's extension: the template's assistant prefix
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension: extra template variables
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


ObjectType = Literal["text_completion", "chat.completion", "chat.completion.chunk"]
