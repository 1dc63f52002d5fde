"""OpenAI request bodies → the gRPC door's GenerateRequest message (so that one validation, one set of limits
and one error mapping serve both doors), and engine outputs → OpenAI response objects."""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc

from lora_compile.errors import AdapterNameError, AdapterPathError
from service._proto import pb
from service.affinity import (
    ADAPTER_ID_HEADER as ADAPTER_HEADER,  # must agree with `model` (gRPC: `adapter`)
)
from service.errors import FieldViolation, InvalidArgument, NotFound
from service.grpc_api.validation import MAX_NAME_CHARS
from service.http_api.errors import HttpError
from service.http_api.protocol import ChatCompletionRequest, CompletionRequest, _Common
from service.runner.request import RequestOutput

# The shared validation names fields by their GenerateRequest path; an HTTP client knows OpenAI's names.
_PARAM = {"stopping.max_new_tokens": "max_tokens", "stopping.stop": "stop", "stopping.stop_token_ids": "stop",
          "response.top_logprobs": "top_logprobs", "adapter": "model", "request_id": "request_id",
          "input": "prompt"}
_FINISH = {"length": "length", "stop": "stop", "eos": "stop", "cancelled": "abort"}  # abort: vLLM's word


def resolve_adapter(model: str, header: str | None, base_model: str) -> str:
    """The adapter a request names ("" = the base model): `model` (empty or the base's name = base), which the
    x-adapter-id header, when sent, must agree with."""
    adapter = "" if model in ("", base_model) else model
    if header is not None:
        from_header = "" if header in ("", base_model) else header
        if from_header != adapter:
            raise InvalidArgument([FieldViolation("model", (
                f"the {ADAPTER_HEADER} header names {header or base_model!r} but the model field names "
                f"{model or base_model!r}; send the same adapter in both (or leave the header out)"))])
    return adapter


def unsupported_fields(body: _Common) -> list[FieldViolation]:
    """OpenAI fields lora-serve does not implement, set to anything but their neutral value."""
    bad = []
    if body.n != 1:
        bad.append(FieldViolation("n", f"only n = 1 is supported (one choice per request), got {body.n}; "
                                       "send several requests instead"))
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) != 0:
            bad.append(FieldViolation(name, "not supported (use repetition_penalty)"))
    if body.logit_bias:
        bad.append(FieldViolation("logit_bias", "not supported"))
    if isinstance(body, CompletionRequest):
        if body.echo:
            bad.append(FieldViolation("echo", "not supported"))
        if body.best_of not in (None, 1):
            bad.append(FieldViolation("best_of", "only best_of = 1 is supported"))
        if body.suffix:
            bad.append(FieldViolation("suffix", "not supported"))
    if isinstance(body, ChatCompletionRequest):
        if body.tools:
            bad.append(FieldViolation("tools", "tool calling is not supported"))
        if body.response_format and body.response_format.get("type", "text") != "text":
            bad.append(FieldViolation("response_format", "only {\"type\": \"text\"} is supported"))
    return bad


def generate_request(body: _Common, adapter: str, request_id: str, *, text: str | None = None,
                     token_ids: list[int] | None = None) -> pb.GenerateRequest:
    """The GenerateRequest a gRPC client would send for this body."""
    msg = pb.GenerateRequest(request_id=request_id, adapter=adapter)
    if text is not None:
        msg.text = text
    else:
        msg.token_ids.ids.extend(token_ids or [])
    s = msg.sampling
    # OpenAI's default temperature is 1 (the gRPC API's is 0, greedy): an OpenAI client that sets none samples.
    s.temperature = 1.0 if body.temperature is None else body.temperature
    for name in ("top_p", "top_k", "seed", "repetition_penalty"):
        if (value := getattr(body, name)) is not None:
            setattr(s, name, value)
    max_tokens = body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    if max_tokens is not None:
        msg.stopping.max_new_tokens = max_tokens
    msg.stopping.stop.extend(body.stop_list())
    msg.stopping.ignore_eos = body.ignore_eos
    if isinstance(body, CompletionRequest):
        if body.logprobs is not None:
            msg.response.logprobs, msg.response.top_logprobs = True, body.logprobs
    else:
        msg.response.logprobs = body.logprobs or bool(body.top_logprobs)
        msg.response.top_logprobs = body.top_logprobs or 0
    return msg


def openai_error(exc: Exception, prompt_param: str) -> Exception:
    """The refusal the shared validation raised, with `param` naming the field as the OpenAI client named it:
    violations renamed, and a refused adapter name (unknown, or not a possible adapter directory entry) is
    `model`'s."""
    if isinstance(exc, (AdapterNameError, AdapterPathError)):  # (gRPC: INVALID_ARGUMENT on `adapter`)
        exc = InvalidArgument([FieldViolation("adapter", str(exc))])
    if isinstance(exc, InvalidArgument):
        return openai_violations(exc, prompt_param)
    if isinstance(exc, NotFound) and exc.resource_type == "adapter":
        return HttpError(404, grpc.StatusCode.NOT_FOUND, str(exc), param=_PARAM["adapter"])
    return exc


def openai_violations(exc: InvalidArgument, prompt_param: str) -> InvalidArgument:
    """The same violations, named as the OpenAI client named the fields."""
    renamed = []
    for v in exc.violations:
        head, sep, rest = v.field.partition("[")
        if head in ("text", "token_ids.ids"):
            name = prompt_param + (sep + rest if head == "token_ids.ids" and prompt_param == "prompt" else "")
        elif head.startswith("sampling."):
            name = head.removeprefix("sampling.") + sep + rest
        else:
            name = _PARAM.get(head, head) + sep + rest
        renamed.append(FieldViolation(name, v.description))
    return InvalidArgument(renamed)


def request_id(prefix: str, header: str | None) -> str:
    """The client's x-request-id when it sent a usable one, else a new id."""
    if header and len(header) <= MAX_NAME_CHARS and header.isprintable():
        return header
    return f"{prefix}-{uuid.uuid4().hex}"


# --- responses ----------------------------------------------------------------------------------------------
def finish_reason(out: RequestOutput) -> str | None:
    return _FINISH.get(out.finish_reason) if out.finish_reason else None


def stop_reason(out: RequestOutput) -> str | int | None:
    """vLLM's extension: the stop string or stop token that ended the request."""
    return out.stop if out.stop is not None else out.stop_token_id


def usage(out: RequestOutput) -> dict[str, Any]:
    """OpenAI's usage; cached_tokens: prompt tokens whose KV the prefix cache held (included in prompt_tokens)."""
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}


def completion_logprobs(out: RequestOutput, pieces: Callable[[list[int]], list[str]], offset: int) -> dict[str, Any]:
    """OpenAI's legacy completions format; `offset`: text characters sent before this output."""
    tops = [dict(zip(pieces([t for t, _ in top]), (p for _, p in top))) for top in out.top_logprobs]
    return {"tokens": pieces(out.token_ids), "token_logprobs": list(out.logprobs),
            "top_logprobs": tops or None, "text_offset": [offset] * len(out.token_ids)}


def chat_logprobs(out: RequestOutput, pieces: Callable[[list[int]], list[str]]) -> dict[str, Any]:
    """OpenAI's chat format: per token, its piece, log-probability, bytes, and the top alternatives."""
    def entry(piece: str, logprob: float) -> dict[str, Any]:
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}

    content = []
    for i, (piece, lp) in enumerate(zip(pieces(out.token_ids), out.logprobs)):
        top = out.top_logprobs[i] if i < len(out.top_logprobs) else []
        content.append(entry(piece, lp) | {"top_logprobs": [
            entry(p, v) for p, (_, v) in zip(pieces([t for t, _ in top]), top)]})
    return {"content": content}


def now() -> int:
    return int(time.time())
