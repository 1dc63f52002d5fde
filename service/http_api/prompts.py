"""A completions call's prompts: one (a string, or token ids) or a list (a list of strings or of token-id lists,
as LangChain's OpenAI(...).batch() and vLLM's clients send), each checked by the request front on its own, with
its refusals naming prompt[i]."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from service.errors import FieldViolation, InvalidArgument
from service.front import FieldNames, GenerateParams

Prompt = str | list[int]


def prompt_list(prompt: str | list) -> list[Prompt]:
    """The prompts of `prompt`: a string or a list of token ids is one prompt; a list of strings or of token-id
    lists, one per item."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def completion_params(prompt: str | list, n: int, max_sequences: int,
                      params_for: Callable[[Prompt], GenerateParams]) -> list[GenerateParams]:
    """One GenerateParams per prompt (`params_for` makes it), each naming its prompt prompt[i] when there are
    several. Refused at once when prompts × n could never be served together (max_sequences)."""
    prompts = prompt_list(prompt)
    if len(prompts) * n > max_sequences:
        raise InvalidArgument([FieldViolation("prompt", (
            f"{len(prompts)} prompts x n = {n} make {len(prompts) * n} sequences; this server holds at most "
            f"{max_sequences} at once (--max-num-seqs + --max-queue); send fewer prompts per request"))])
    out = []
    for i, p in enumerate(prompts):
        params = params_for(p)
        if len(prompts) > 1:
            names = params.names.names
            params = dataclasses.replace(params, names=FieldNames({
                **names, **{f: _indexed(names.get(f, f), i) for f in ("input", "text", "token_ids")}}))
        out.append(params)
    return out


def _indexed(name: str, i: int) -> str:
    """prompt → prompt[i]; prompt[] (items prompt[j]) → prompt[i][] (items prompt[i][j])."""
    return f"{name[:-2]}[{i}][]" if name.endswith("[]") else f"{name}[{i}]"

