"""OpenAI request bodies → GenerateParams (checked by service/front/prepare.py, as the gRPC door's are), with every
field named in refusals as the OpenAI client named it; and the refusals of what lora-serve does not honour."""
from __future__ import annotations

import uuid
from typing import Any

import grpc

from service.affinity import (
    ADAPTER_ID_HEADER as ADAPTER_HEADER,  # must agree with `model` (gRPC: `adapter`)
)
from service.errors import FieldViolation, InvalidArgument, NotFound
from service.front.generate_params import FieldNames, GenerateParams
from service.http_api.adapter_mixes import RequestedMix, not_found
from service.http_api.errors import HttpError
from service.http_api.protocol import ChatCompletionRequest, CompletionRequest, _Common
from service.http_api.structured import structured_output
from service.http_api.tool_calls import ToolPlan
from service.limits import MAX_NAME_CHARS, MAX_REPORTED_BAD_IDS

_NAMES = {"adapter": "model", "stop": "stop[]", "stop_token_ids": "stop_token_ids[]", "max_new_tokens": "max_tokens"}
COMPLETION_NAMES = FieldNames(_NAMES | {"input": "prompt", "text": "prompt", "token_ids": "prompt[]",
                                        "top_logprobs": "logprobs"})
# (a chat's prompt is the rendered template: its problems are the messages')
CHAT_NAMES = FieldNames(_NAMES | {"input": "messages", "text": "messages", "token_ids": "messages"})
CHAT_NAMES_MAX_COMPLETION = FieldNames(CHAT_NAMES.names | {"max_new_tokens": "max_completion_tokens"})

# vLLM's (and OpenAI's) fields lora-serve does not honour: refused by name unless None, empty or one of the
# neutral values given (each field's default in vLLM, where it has no effect).
NOT_HONOURED: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "beam search is not supported"),
    "length_penalty": ((1.0,), "applies to beam search, which is not supported"),
    "include_stop_str_in_output": ((False,), "not supported: a matched stop string is left out of the text"),
    "min_tokens": ((0,), "not supported"),
    "skip_special_tokens": ((True,), "not supported: special tokens are always left out of the text"),
    "spaces_between_special_tokens": ((True,), "not supported: special tokens are always left out of the text"),
    "truncate_prompt_tokens": ((), "prompt truncation is not supported: send a prompt that fits"),
    "allowed_token_ids": ((), "not supported (logit_bias can favour tokens)"),
    "bad_words": ((), "not supported (logit_bias can ban tokens)"),
    "logprob_token_ids": ((), "not supported (use logprobs / top_logprobs)"),
    "watermarking": ((False,), "not supported"),
    "priority": ((0,), "priority scheduling is not supported (requests are served first come, first served)"),
    "cache_salt": ((), "not supported"),
    "kv_transfer_params": ((), "disaggregated serving is not supported"),
    "ec_transfer_params": ((), "disaggregated serving is not supported"),
    "vllm_xargs": ((), "not supported (no request extensions)"),
    "repetition_detection": ((), "not supported"),
    "thinking_token_budget": ((-1,), "not supported (no reasoning parser)"),
    "stream_interval": ((1,), "not supported: each engine step's tokens are sent as soon as they come"),
    "return_tokens_as_token_ids": ((False,), "not supported"),
    # completions
    "suffix": ((), "not supported"),
    "prompt_embeds": ((), "not supported (text or token id prompts)"),
    # chat
    "reasoning_effort": ((), "not supported (no reasoning parser)"),
    "continue_final_message": ((False,), "not supported"),
    "chat_template": ((), "not supported: the model's own chat template is used"),
    "media_io_kwargs": ((), "not supported (text-only models)"),
    "mm_processor_kwargs": ((), "not supported (text-only models)"),
    "return_prompt_text": ((False,), "not supported"),
}
_NOT_HONOURED_ON_CHAT = {"echo": ((False,), "not supported on chat completions (/v1/completions echoes the prompt)")}
REMOVED_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
                         "guided_whitespace_pattern")


def _guided_replacement(name: str) -> str:
    key = name.removeprefix("guided_")
    if key in ("json", "regex", "choice", "grammar"):
        return f'{{"structured_outputs": {{"{key}": ...}}}}'
    return "structured_outputs (llguidance is its one backend)" if key == "decoding_backend" else "structured_outputs"


def unsupported_fields(body: _Common) -> list[FieldViolation]:
    """The fields this body sets that lora-serve does not honour (each named, so none is silently dropped)."""
    chat = isinstance(body, ChatCompletionRequest)
    bad = [FieldViolation(name, f"removed from vLLM's API: use {_guided_replacement(name)}; refused rather than "
                                "ignored") for name in REMOVED_GUIDED_FIELDS if getattr(body, name) is not None]
    for name, (neutral, why) in (NOT_HONOURED | (_NOT_HONOURED_ON_CHAT if chat else {})).items():
        value = getattr(body, name, None)
        if value is not None and value not in ([], {}) and value not in neutral:
            bad.append(FieldViolation(name, why))
    if isinstance(body, CompletionRequest) and body.best_of not in (None, 1):
        bad.append(FieldViolation("best_of", "only best_of = 1 is supported"))
    if body.stream and body.prompt_logprobs:  # (vLLM refuses it too)
        bad.append(FieldViolation("prompt_logprobs", "not available when stream is true"))
    return bad


def resolve_adapter(model: str, header: str | None, base_models: tuple[str, ...]) -> str:
    """The adapter a request names ("" = the base model): `model` (empty or one of the base model's served names
    = base), which the x-adapter-id header, when sent, must agree with."""
    base = base_models[0]
    adapter = "" if model == "" or model in base_models else model
    if header is not None:
        from_header = "" if header == "" or header in base_models else header
        if from_header != adapter:
            raise InvalidArgument([FieldViolation("model", (
                f"the {ADAPTER_HEADER} header names {header or base!r} but the model field names "
                f"{model or base!r}; send the same adapter in both (or leave the header out)"))])
    return adapter


def request_id(prefix: str, header: str | None, body_id: str | None = None) -> str:
    """The client's x-request-id when it sent a usable one; else vLLM's `<prefix>-<request_id>` when the body
    names one (prepare refuses one too long); else a new id."""
    if header and len(header) <= MAX_NAME_CHARS and header.isprintable():
        return header
    return f"{prefix}-{body_id or uuid.uuid4().hex}"


def generate_params(body: _Common, adapter: str, request_id: str, *, text: str | None = None,
                    token_ids: list[int] | None = None, tools: ToolPlan | None = None,
                    mix: RequestedMix = RequestedMix()) -> GenerateParams:
    """What a gRPC client would send for this body (one prompt: `text` or `token_ids`); `tools`: the call's tool
    plan, whose forced calls are its structured output; `mix`: the adapters it mixes (adapter_mixes.py)."""
    if isinstance(body, ChatCompletionRequest):
        max_tokens, names = body.max_tokens, CHAT_NAMES
        if body.max_completion_tokens is not None:
            max_tokens, names = body.max_completion_tokens, CHAT_NAMES_MAX_COMPLETION
        logprobs, top_logprobs, prompt_logprobs = body.logprobs or bool(body.top_logprobs), body.top_logprobs, None
    else:
        max_tokens, names = body.max_tokens, COMPLETION_NAMES
        logprobs, top_logprobs = body.logprobs is not None, body.logprobs
        # echo with logprobs: the prompt's log-probabilities too (vLLM's rule)
        prompt_logprobs = body.logprobs if body.echo else None
    constraint = structured_output(body.response_format, body.structured_outputs)
    if tools is not None and tools.constraint is not None:
        if constraint is not None:
            raise InvalidArgument([FieldViolation("tool_choice", (
                f"a forced tool call holds the output to the tool's parameters; drop {constraint[1]} (or use "
                "tool_choice \"auto\")"))])
        constraint = (tools.constraint, "tools")
    fields = dict(names.names) | ({"structured_output": constraint[1]} if constraint is not None else {})
    return GenerateParams(
        names=mix.names(fields), request_id=request_id, adapter=adapter, adapters=mix.members, text=text,
        token_ids=token_ids,
        add_special_tokens=body.add_special_tokens,
        # OpenAI's default temperature is 1 (the gRPC API's is 0, greedy): an OpenAI client that sets none samples.
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, seed=body.seed,
        repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, logit_bias=_logit_bias(body.logit_bias), n=body.n,
        max_new_tokens=max_tokens, stop=body.stop_list(), stop_token_ids=body.stop_token_ids or (),
        ignore_eos=body.ignore_eos, logprobs=logprobs, top_logprobs=top_logprobs or 0,
        prompt_logprobs=body.prompt_logprobs if body.prompt_logprobs is not None else prompt_logprobs,
        structured_output=constraint[0] if constraint else None,
    )


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's keys are token ids written as strings (JSON keys are strings): parsed here; their vocabulary,
    the biases and the count are checked with the rest (prepare)."""
    if not raw:
        return {}
    out, bad = {}, []
    for key, bias in raw.items():
        if key.isascii() and key.isdigit():
            out[int(key)] = bias
        else:
            bad.append(key)
    if bad:
        quoted = ", ".join(repr(k[:32]) for k in bad[:MAX_REPORTED_BAD_IDS])
        more = f" and {len(bad) - MAX_REPORTED_BAD_IDS} more" if len(bad) > MAX_REPORTED_BAD_IDS else ""
        raise InvalidArgument([FieldViolation("logit_bias", f"keys must be token ids (non-negative integers, "
                                                            f"as strings); got {quoted}{more}")])
    return out


def openai_error(exc: Exception, mix: RequestedMix = RequestedMix()) -> Exception:
    """404 for an adapter that is not loaded: `model`'s, or the mix's entry that names it."""
    if isinstance(exc, NotFound) and exc.resource_type == "adapter":
        return HttpError(404, grpc.StatusCode.NOT_FOUND, str(exc), param=not_found(exc, mix))
    return exc
