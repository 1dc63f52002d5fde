"""GenerateRequest (proto) → GenerationRequest, or InvalidArgument naming every bad field.

Checks everything the engine would refuse, so a request fails here, with a field name, and never
inside a step. Unknown adapters are the servicer's business (NOT_FOUND, not INVALID_ARGUMENT).
"""
from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from lora_compile import SamplingParams

from ._proto import pb
from .errors import FieldViolation, InvalidArgument
from .request import GenerationRequest

MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64


@dataclass(frozen=True)
class Limits:
    vocab_size: int       # token ids must be below this
    max_seq_len: int      # prompt + new tokens
    max_top_logprobs: int = 20


def validate_generate(request: pb.GenerateRequest, prompt_ids: list[int] | None, limits: Limits) -> GenerationRequest:
    """`prompt_ids`: the tokenized text (the caller tokenizes), or None to take request.token_ids."""
    bad: list[FieldViolation] = []
    sampling = _sampling_fields(request.sampling, bad)
    stopping = request.stopping

    input_field = request.WhichOneof("input")
    if input_field is None:
        bad.append(FieldViolation("input", "set text or token_ids"))
        prompt_ids = []
    elif input_field == "token_ids":
        prompt_ids = list(request.token_ids.ids)
        for i, token in enumerate(prompt_ids):
            if token >= limits.vocab_size:
                bad.append(FieldViolation(f"token_ids.ids[{i}]",
                                          f"token id {token} is outside the vocabulary [0, {limits.vocab_size})"))
    prompt_ids = prompt_ids or []
    if input_field is not None:
        field = "text" if input_field == "text" else "token_ids.ids"
        if not prompt_ids or (input_field == "text" and not request.text):  # BOS alone is no prompt
            bad.append(FieldViolation(field, "the prompt is empty"))
        elif len(prompt_ids) >= limits.max_seq_len:
            bad.append(FieldViolation(field, f"the prompt has {len(prompt_ids)} tokens; the context holds "
                                             f"{limits.max_seq_len}, including at least one new token"))

    room = max(1, limits.max_seq_len - len(prompt_ids))
    if stopping.HasField("max_new_tokens"):
        max_new_tokens = stopping.max_new_tokens
        if max_new_tokens < 1:
            bad.append(FieldViolation("stopping.max_new_tokens", "must be >= 1"))
        elif prompt_ids and len(prompt_ids) + max_new_tokens > limits.max_seq_len:
            bad.append(FieldViolation(
                "stopping.max_new_tokens",
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the context "
                f"(max_seq_len {limits.max_seq_len}); at most {room}"))
    else:
        max_new_tokens = room  # unset: up to the end of the context
    if len(stopping.stop) > MAX_STOP_STRINGS:
        bad.append(FieldViolation("stopping.stop", f"at most {MAX_STOP_STRINGS} stop strings"))
    for i, stop in enumerate(stopping.stop):
        if not stop:
            bad.append(FieldViolation(f"stopping.stop[{i}]", "must not be empty"))
    if len(stopping.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        bad.append(FieldViolation("stopping.stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids"))
    for i, token in enumerate(stopping.stop_token_ids):
        if token >= limits.vocab_size:
            bad.append(FieldViolation(f"stopping.stop_token_ids[{i}]",
                                      f"token id {token} is outside the vocabulary [0, {limits.vocab_size})"))
    if request.response.top_logprobs > limits.max_top_logprobs:
        bad.append(FieldViolation("response.top_logprobs", f"must be <= {limits.max_top_logprobs}"))
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


def _sampling_fields(sampling: pb.SamplingParams, bad: list[FieldViolation]) -> dict:
    """The set fields, checked; unset ones are left to SamplingParams' defaults."""
    out: dict = {}

    def number(name: str, ok, rule: str) -> None:
        if not sampling.HasField(name):
            return
        value = getattr(sampling, name)
        if isinstance(value, float) and not math.isfinite(value):
            bad.append(FieldViolation(f"sampling.{name}", f"must be a finite number, got {value}"))
        elif not ok(value):
            bad.append(FieldViolation(f"sampling.{name}", f"{rule}, got {value:g}"))
        else:
            out[name] = value

    number("temperature", lambda v: v >= 0, "must be >= 0 (0 = greedy)")
    number("top_p", lambda v: 0 < v <= 1, "must be in (0, 1]")
    number("top_k", lambda v: v >= 0, "must be >= 0 (0 = off)")
    number("repetition_penalty", lambda v: v > 0, "must be > 0 (1 = off)")
    if sampling.HasField("seed"):
        out["seed"] = sampling.seed
    return out
