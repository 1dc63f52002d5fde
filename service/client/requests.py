"""GenerateRequest messages from the SDK's keyword arguments, and the call metadata a balancer routes on: what both
clients (sdk.py) send. No torch, nothing of the server's."""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from service._proto import pb
from service.affinity import ADAPTER_ID_HEADER, adapter_header_value


def build_generate_request(
    prompt: str | Sequence[int] | Sequence[Mapping], *, adapter: str | None = None,
    adapters: Mapping[str, float] | Sequence[tuple[str, float]] | None = None, max_new_tokens: int | None = None,
    temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
    min_p: float | None = None, seed: int | None = None, repetition_penalty: float | None = None,
    presence_penalty: float | None = None, frequency_penalty: float | None = None,
    logit_bias: Mapping[int, float] | None = None, n: int | None = None, stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (), ignore_eos: bool = False, logprobs: bool = False,
    top_logprobs: int = 0, prompt_logprobs: int | None = None, request_id: str = "",
    json_schema: Mapping | str | None = None, json_object: bool = False, regex: str | None = None,
    choice: Sequence[str] | None = None, grammar: str | None = None,
) -> pb.GenerateRequest:
    """None leaves a field unset (server default); text prompts are tokenized by the server; a list of OpenAI chat
    messages ({"role": ..., "content": ...}) is rendered with the model's chat template. `adapters`: a weighted
    mix instead of `adapter`, {name: weight} or (name, weight) pairs, in PEFT's cat order. `logit_bias`: token
    id -> bias added to its logit; `n`: choices from the one prompt (each chunk's `index` says which);
    `prompt_logprobs`: the prompt's log-probabilities and top k (in the first chunk). At most one of
    `json_schema` (a dict or its JSON text), `json_object`, `regex`, `choice`, `grammar`: the output held to it."""
    req = pb.GenerateRequest(request_id=request_id, adapter=adapter or "")
    for name, weight in _mix_members(adapters):
        req.adapters.add(name=name, weight=weight)
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt and isinstance(prompt[0], Mapping):  # OpenAI's chat messages: the server's template renders them
        req.chat.SetInParent()
        for m in prompt:
            msg = req.chat.messages.add(role=m["role"], content=m.get("content") or "", name=m.get("name") or "",
                                        tool_call_id=m.get("tool_call_id") or "")
            for c in m.get("tool_calls") or ():
                fn = c["function"]
                args = fn["arguments"] if isinstance(fn["arguments"], str) else json.dumps(fn["arguments"])
                msg.tool_calls.add(id=c.get("id", ""), name=fn["name"], arguments=args)
    else:
        req.token_ids.ids.extend(prompt)
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("min_p", min_p),
                        ("seed", seed), ("repetition_penalty", repetition_penalty),
                        ("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty), ("n", n)):
        if value is not None:
            setattr(req.sampling, name, value)
    req.sampling.logit_bias.update(logit_bias or {})
    if max_new_tokens is not None:
        req.stopping.max_new_tokens = max_new_tokens
    req.stopping.stop.extend(stop)
    req.stopping.stop_token_ids.extend(stop_token_ids)
    req.stopping.ignore_eos = ignore_eos
    req.response.logprobs = logprobs
    req.response.top_logprobs = top_logprobs
    if prompt_logprobs is not None:
        req.response.prompt_logprobs = prompt_logprobs
    _structured_output(req.structured_output, json_schema, json_object, regex, choice, grammar)
    return req


def _mix_members(adapters) -> list[tuple[str, float]]:
    if adapters is None:
        return []
    if isinstance(adapters, str):  # iterating it would send one member per character
        raise TypeError("adapters: a mapping {name: weight} or (name, weight) pairs, not a string")
    return [(name, float(weight)) for name, weight in (adapters.items() if isinstance(adapters, Mapping)
                                                       else adapters)]


def _structured_output(so: pb.StructuredOutput, json_schema, json_object, regex, choice, grammar) -> None:
    given = [name for name, v in (("json_schema", json_schema), ("json_object", json_object or None),
                                  ("regex", regex), ("choice", choice), ("grammar", grammar)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"at most one structured output, got {', '.join(given)}")
    if json_schema is not None:
        so.json_schema = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
    elif json_object:
        so.json_object = True
    elif regex is not None:
        so.regex = regex
    elif choice is not None:
        so.choice.choices.extend(choice)
    elif grammar is not None:
        so.grammar = grammar


def generate_metadata(metadata: tuple[tuple[str, str], ...] | None, params: dict) -> tuple[tuple[str, str], ...]:
    """Call metadata for Generate: x-adapter-id, so a balancer can keep each adapter on few replicas. None for a
    mix: no one adapter names where it is warm (and "" would claim the base model)."""
    value = None if params.get("adapters") else adapter_header_value(params.get("adapter"))
    return (*(metadata or ()), *(((ADAPTER_ID_HEADER, value),) if value is not None else ()))
