"""GenerateRequest (proto) → GenerationRequest, or InvalidArgument naming every bad field.

Checks everything the engine would refuse, so a request fails here, with a field name, and never
inside a step. Unknown adapters are the servicer's business (NOT_FOUND, not INVALID_ARGUMENT).
"""
from __future__ import annotations

import uuid

from lora_compile import SamplingParams
from lora_compile.sampling import SAMPLING_RULES, sampling_problem
from service._proto import pb
from service.errors import FieldViolation, InvalidArgument
from service.limits import RequestLimits
from service.runner.request import GenerationRequest, ModelInfo

MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_STOP_CHARS = 256  # per stop string: longer ones would hold back that much text
MAX_NAME_CHARS = 256  # request_id (echoed in every response) and adapter (echoed in NOT_FOUND)
MAX_REPORTED_BAD_IDS = 8  # per repeated field: enough to fix the request, small enough for a status
MAX_TOP_LOGPROBS = 20


def validate_generate(request: pb.GenerateRequest, prompt_ids: list[int] | None, limits: RequestLimits,
                      model: ModelInfo) -> GenerationRequest:
    """`prompt_ids`: the tokenized text (the caller tokenizes), or None to take request.token_ids."""
    bad: list[FieldViolation] = []
    sampling = _sampling_fields(request.sampling, bad)
    stopping = request.stopping
    for name in ("request_id", "adapter"):
        if len(getattr(request, name)) > MAX_NAME_CHARS:
            bad.append(FieldViolation(name, f"at most {MAX_NAME_CHARS} characters, got {len(getattr(request, name))}"))

    input_field = request.WhichOneof("input")
    max_prompt = min(model.max_seq_len - 1, limits.max_prompt_tokens or model.max_seq_len)
    if input_field is None:
        bad.append(FieldViolation("input", "set text or token_ids"))
        prompt_ids = []
    elif input_field == "token_ids":
        prompt_ids = request.token_ids.ids
        if len(prompt_ids) <= max_prompt:  # (a too long prompt is refused below, without reading every id)
            prompt_ids = list(prompt_ids)
            _check_ids(prompt_ids, "token_ids.ids", model.vocab_size, bad)
    prompt_ids = prompt_ids or []
    if input_field is not None:
        field = "text" if input_field == "text" else "token_ids.ids"
        if not prompt_ids or (input_field == "text" and not request.text):  # BOS alone is no prompt
            bad.append(FieldViolation(field, "the prompt is empty"))
        elif len(prompt_ids) >= model.max_seq_len:
            bad.append(FieldViolation(field, f"the prompt has {len(prompt_ids)} tokens; the context holds "
                                             f"{model.max_seq_len}, including at least one new token"))
        elif len(prompt_ids) > max_prompt:
            bad.append(FieldViolation(field, f"the prompt has {len(prompt_ids)} tokens; this server accepts "
                                             f"at most {max_prompt} (--max-prompt-tokens)"))

    room = max(1, model.max_seq_len - len(prompt_ids))
    if stopping.HasField("max_new_tokens"):
        max_new_tokens = stopping.max_new_tokens
        if max_new_tokens < 1:
            bad.append(FieldViolation("stopping.max_new_tokens", "must be >= 1"))
        elif limits.max_new_tokens is not None and max_new_tokens > limits.max_new_tokens:
            bad.append(FieldViolation("stopping.max_new_tokens", f"this server allows at most "
                                      f"{limits.max_new_tokens} new tokens per request (--max-new-tokens-limit)"))
        elif prompt_ids and len(prompt_ids) + max_new_tokens > model.max_seq_len:
            bad.append(FieldViolation(
                "stopping.max_new_tokens",
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the context "
                f"(max_seq_len {model.max_seq_len}); at most {room}"))
    else:  # unset: up to the end of the context, or the operator's limit
        max_new_tokens = min(room, limits.max_new_tokens or room)
    if len(stopping.stop) > MAX_STOP_STRINGS:
        bad.append(FieldViolation("stopping.stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stopping.stop)}"))
    else:  # (a huge list is refused as a whole, not walked)
        for i, stop in enumerate(stopping.stop):
            if not stop:
                bad.append(FieldViolation(f"stopping.stop[{i}]", "must not be empty"))
            elif len(stop) > MAX_STOP_CHARS:
                bad.append(FieldViolation(f"stopping.stop[{i}]", f"at most {MAX_STOP_CHARS} characters"))
    if len(stopping.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        bad.append(FieldViolation("stopping.stop_token_ids",
                                  f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(stopping.stop_token_ids)}"))
    else:
        _check_ids(stopping.stop_token_ids, "stopping.stop_token_ids", model.vocab_size, bad)
    if request.response.top_logprobs > MAX_TOP_LOGPROBS:
        bad.append(FieldViolation("response.top_logprobs", f"must be <= {MAX_TOP_LOGPROBS}"))
    if bad:
        raise InvalidArgument(bad)

    try:  # the engine's own checks; everything above should make this unreachable
        params = SamplingParams(
            **sampling, max_new_tokens=max_new_tokens, stop_token_ids=tuple(stopping.stop_token_ids),
            ignore_eos=stopping.ignore_eos, logprobs=request.response.logprobs,
            top_logprobs=request.response.top_logprobs,
        )
    except ValueError as e:
        raise InvalidArgument([FieldViolation("sampling", str(e))]) from e
    return GenerationRequest(
        request_id=request.request_id or uuid.uuid4().hex,
        prompt_ids=prompt_ids,
        sampling=params,
        adapter=request.adapter or None,
        stop=tuple(stopping.stop),
    )


def _check_ids(ids, field: str, vocab_size: int, bad: list[FieldViolation]) -> None:
    """Ids outside the vocabulary: the first few by index, then a count (the status must stay small)."""
    out_of_range = [(i, t) for i, t in enumerate(ids) if t >= vocab_size]
    for i, token in out_of_range[:MAX_REPORTED_BAD_IDS]:
        bad.append(FieldViolation(f"{field}[{i}]", f"token id {token} is outside the vocabulary [0, {vocab_size})"))
    if len(out_of_range) > MAX_REPORTED_BAD_IDS:
        bad.append(FieldViolation(field, f"{len(out_of_range) - MAX_REPORTED_BAD_IDS} more ids are outside "
                                         f"the vocabulary [0, {vocab_size})"))


def _sampling_fields(sampling: pb.SamplingParams, bad: list[FieldViolation]) -> dict:
    """The set fields, checked; unset ones are left to SamplingParams' defaults."""
    out: dict = {}

    for name in SAMPLING_RULES:
        if not sampling.HasField(name):
            continue
        value = getattr(sampling, name)
        if (problem := sampling_problem(name, value)) is not None:
            bad.append(FieldViolation(f"sampling.{name}", problem))
        else:
            out[name] = value
    if sampling.HasField("seed"):
        out["seed"] = sampling.seed
    return out
