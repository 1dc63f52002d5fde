"""OpenAI request bodies (pydantic, strict types) for /v1/completions and /v1/chat/completions, with vLLM's extra
fields (vLLM 0.32's names and defaults: its completion and chat protocol).

Only the wire types and the ranges a field can hold are checked here; what the values mean (sampling rules,
prompt and token limits) is checked once, by service/front/prepare.py, for both doors (see openai_params.py). Every
vLLM field is declared: it is either honoured, or refused by name unless left at its neutral value
(openai_params.NOT_HONOURED); unknown fields are ignored, as OpenAI and vLLM do.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

U32 = Annotated[StrictInt, Field(ge=0, le=2**32 - 1)]
I32 = Annotated[StrictInt, Field(ge=-(2**31), le=2**31 - 1)]
U64 = Annotated[StrictInt, Field(ge=0, le=2**64 - 1)]
Number = Annotated[float, Field(strict=True)]  # (strict float accepts JSON integers too)
TopLogprobs = Annotated[StrictInt, Field(ge=0, le=20)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: StrictBool = False


MAX_LORA_ENTRIES = 64  # llama.cpp's `lora` may list adapters at scale 0 (off): bounds the id look-ups


class AdapterWeight(BaseModel):
    """One member of a weighted mix (`adapters`): an adapter by name, at weight 1 unless given."""

    model_config = ConfigDict(extra="forbid", strict=True)  # (a misspelt "weight" is refused, not read as 1)
    name: Annotated[StrictStr, Field(min_length=1)]
    weight: Number = 1.0


class LoraScale(BaseModel):
    """One entry of llama.cpp's per-request `lora`: an adapter by its GET /lora-adapters id, and its scale."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: Annotated[StrictInt, Field(ge=0)]
    scale: Number  # required: llama.cpp reads a missing scale as 0 (off), which is rarely what was meant


class _Common(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored (as OpenAI and vLLM do)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: StrictStr = ""
    max_tokens: U32 | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    seed: U64 | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: I32 | None = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[StrictStr, Number] | None = None  # token id (a string, JSON keys are) -> bias
    user: StrictStr | None = None  # accepted and ignored (OpenAI's abuse-monitoring id)
    response_format: dict[str, Any] | None = None  # text, json_object, json_schema (http_api/structured.py)
    # vLLM's sampling fields
    top_k: I32 | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    stop_token_ids: list[U32] | None = None
    ignore_eos: StrictBool = False
    prompt_logprobs: I32 | None = None
    # vLLM's other fields
    request_id: StrictStr | None = None  # the response's id (after x-request-id, which wins)
    return_token_ids: StrictBool | None = False  # each choice also carries its token ids
    session_id: StrictStr | None = None  # a routing / logging hint in vLLM: no effect here either
    routed_experts_prompt_start: StrictInt = 0  # about routed-expert data, which is never returned (no MoE)
    truncation_side: Literal["left", "right"] | None = None  # no effect without truncate_prompt_tokens
    # A weighted mix of adapters (http_api/adapter_mixes.py): by name, or by id as llama.cpp's server takes them
    adapters: list[AdapterWeight] | None = None
    lora: Annotated[list[LoraScale], Field(max_length=MAX_LORA_ENTRIES)] | None = None
    # vLLM's fields lora-serve does not honour: refused unless neutral (openai_params.NOT_HONOURED)
    use_beam_search: StrictBool = False
    length_penalty: Number = 1.0
    include_stop_str_in_output: StrictBool = False
    min_tokens: StrictInt = 0
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    truncate_prompt_tokens: StrictInt | None = None
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[StrictStr] | None = None
    logprob_token_ids: list[StrictInt] | None = None
    watermarking: StrictBool | None = None
    structured_outputs: dict[str, Any] | None = None
    priority: StrictInt = 0
    cache_salt: StrictStr | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: StrictInt | None = None
    stream_interval: StrictInt | None = None
    return_tokens_as_token_ids: StrictBool | None = None
    # Guided decoding, removed from vLLM's API (vLLM now ignores these, leaving the output unconstrained):
    # refused by name (openai_params.REMOVED_GUIDED_FIELDS).
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Common):
    prompt: StrictStr | list[U32] | list[StrictStr] | list[list[U32]]
    logprobs: TopLogprobs | None = None  # top-k per position, as OpenAI's legacy API
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None
    max_tokens: U32 | None = 16  # OpenAI's default for completions
    add_special_tokens: StrictBool = True  # vLLM's: BOS... added to a text prompt
    prompt_embeds: Any = None  # vLLM's (refused)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # (tool calls, names... reach the template as given)
    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None


def dumped(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template takes them (what the client sent, nulls left out)."""
    return [m.model_dump(exclude_none=True) for m in messages]


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: StrictBool = False
    top_logprobs: TopLogprobs | None = None
    max_completion_tokens: U32 | None = None  # OpenAI's newer name for max_tokens
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None  # unset: "auto" with tools and a parser (tool_calls.py)
    parallel_tool_calls: StrictBool | None = True  # false: "required" makes one call at most
    reasoning_effort: StrictStr | None = None
    include_reasoning: StrictBool = True  # no effect: no reasoning parser
    # vLLM's chat fields
    add_generation_prompt: StrictBool = True  # the template's assistant prefix
    add_special_tokens: StrictBool = False  # the template writes them
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables
    documents: list[dict[str, StrictStr]] | None = None  # the template's `documents` (RAG templates)
    echo: StrictBool = False  # vLLM's chat echo (prepend the last message of the same role): refused
    continue_final_message: StrictBool = False
    chat_template: StrictStr | None = None
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    return_prompt_text: StrictBool | None = None


ObjectType = Literal["text_completion", "chat.completion", "chat.completion.chunk"]
