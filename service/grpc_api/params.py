"""GenerateRequest (proto) → GenerateParams, with the fields named by their GenerateRequest paths in refusals."""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from service._proto import pb
from service.front.generate_params import FieldNames, GenerateParams

_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "n")
GRPC_NAMES = FieldNames({
    **{name: f"sampling.{name}" for name in _SAMPLING}, "logit_bias": "sampling.logit_bias",
    "token_ids": "token_ids.ids[]", "max_new_tokens": "stopping.max_new_tokens", "stop": "stopping.stop[]",
    "stop_token_ids": "stopping.stop_token_ids[]", "top_logprobs": "response.top_logprobs",
    "prompt_logprobs": "response.prompt_logprobs", "adapters": "adapters[]",
})


def from_proto(request: pb.GenerateRequest) -> GenerateParams:
    """Never raises; repeated fields and the map are passed as the message's containers (not copied: a huge
    one is refused by its length)."""
    sampling, stopping, response = request.sampling, request.stopping, request.response
    optional = {name: getattr(sampling, name) for name in _SAMPLING if sampling.HasField(name)}
    if stopping.HasField("max_new_tokens"):
        optional["max_new_tokens"] = stopping.max_new_tokens
    if response.HasField("prompt_logprobs"):
        optional["prompt_logprobs"] = response.prompt_logprobs
    prompt = request.WhichOneof("input")
    return GenerateParams(
        structured_output=_structured_output(request),
        names=GRPC_NAMES, request_id=request.request_id, adapter=request.adapter,
        adapters=_AdapterWeights(request.adapters),
        text=request.text if prompt == "text" else None,
        token_ids=request.token_ids.ids if prompt == "token_ids" else None,
        logit_bias=sampling.logit_bias, stop=stopping.stop, stop_token_ids=stopping.stop_token_ids,
        ignore_eos=stopping.ignore_eos, logprobs=response.logprobs, top_logprobs=response.top_logprobs,
        **optional,
    )


class _AdapterWeights(Sequence):
    """GenerateRequest.adapters as (name, weight) pairs, read one item at a time: its length is known without a
    copy, so prepare.py refuses an oversized mix before it reads any member."""

    def __init__(self, members) -> None:
        self._members = members

    def __len__(self) -> int:
        return len(self._members)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [(m.name, m.weight) for m in self._members[index]]
        member = self._members[index]
        return member.name, member.weight


def chat_messages(chat: pb.Chat) -> list[dict[str, Any]]:
    """OpenAI's message dicts, as the HTTP door gives the chat template (unset fields left out)."""
    out = []
    for m in chat.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.name:
            message["name"] = m.name
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in m.tool_calls]
        out.append(message)
    return out


def add_generation_prompt(chat: pb.Chat) -> bool:
    return chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True


def _structured_output(request: pb.GenerateRequest) -> tuple[str, str] | None:
    if not request.HasField("structured_output"):
        return None
    so = request.structured_output
    kind = so.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not so.json_object):
        return None
    if kind == "choice":
        return "choice", json.dumps(list(so.choice.choices))
    if kind == "json_object":
        return "json_object", ""
    return ("json" if kind == "json_schema" else kind), getattr(so, kind)  # (the oneof's names are the kinds')
