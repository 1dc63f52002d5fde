"""The model's chat template (tokenizer_config.json `chat_template`), rendered as transformers renders it: jinja2's
ImmutableSandboxedEnvironment (a template cannot reach Python internals or mutate what it is given), trim_blocks
and lstrip_blocks, `raise_exception` for templates that refuse a conversation, loop controls."""
from __future__ import annotations

import functools
import json
import logging
import re
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from service.errors import FailedPrecondition, FieldViolation, InvalidArgument

log = logging.getLogger(__name__)
MAX_QUOTED = 300  # characters of a template's own text (or a name) quoted in a message


class ChatTemplateError(ValueError):
    """The template refused the conversation (raise_exception) or failed to render it. The message is ours (it
    names the message and field where that can be told, or quotes the template's own raise_exception text):
    never jinja2's or Python's wording, which would show the server's internals."""


class _Refused(Exception):
    """The template called raise_exception(text)."""


class _Missing(Exception):
    """An operation in the template needed a value that is not there (`name` of `obj`, or a variable)."""

    def __init__(self, obj: Any, name: Any, message: str = ""):
        super().__init__(message)
        self.obj, self.name = obj, name


class _Undefined(jinja2.Undefined):
    """jinja2's default (as transformers renders): a missing value renders as nothing, until an operation needs it;
    then it raises _Missing, which says which value it was (jinja2's operators all raise `exc`)."""

    __slots__ = ()

    def __init__(self, hint: str | None = None, obj: Any = jinja2.utils.missing, name: str | None = None,
                 exc: Any = None):
        if exc is None or exc is jinja2.exceptions.UndefinedError:  # (the sandbox passes SecurityError: kept)
            exc = functools.partial(_Missing, obj, name)
        super().__init__(hint, obj, name, exc=exc)


def _raise_exception(message: str) -> None:
    raise _Refused(str(message))


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols],
                                            undefined=_Undefined)
        env.filters["tojson"] = _tojson  # transformers' version: no HTML escaping
        env.globals["raise_exception"] = _raise_exception
        self._template = env.from_string(source)
        self._special = special_tokens  # bos_token, eos_token, ... as the template expects them

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               extra: dict[str, Any] | None = None) -> str:
        try:
            return self._template.render(**(extra or {}), **self._special, messages=messages,
                                         add_generation_prompt=add_generation_prompt)
        except _Refused as e:
            raise ChatTemplateError(f"the model's chat template refused them: {str(e)[:MAX_QUOTED]}") from None
        except _Missing as e:
            raise ChatTemplateError(_missing(e, messages)) from None
        except Exception as e:  # noqa: BLE001 - whatever the template's code raised on these messages
            log.debug("chat template failed: %s: %s", type(e).__name__, e)  # (the operator's detail, not the client's)
            what = ("an operation its sandbox forbids" if isinstance(e, jinja2.exceptions.SecurityError)
                    else "a value it does not handle")
            raise ChatTemplateError(f"the model's chat template cannot render them: it failed on {what} (check "
                                    "each message's role and content, and chat_template_kwargs)") from None


def _missing(e: _Missing, messages: list[dict[str, Any]]) -> str:
    """Which value the template needed: a field of a message (or of a part of one), or a variable."""
    name = repr(e.name)[:MAX_QUOTED]
    if e.obj is jinja2.utils.missing:
        return (f"the model's chat template needs the variable {name}, which the request does not set (template "
                "variables come from chat_template_kwargs)")
    where = _path_to(e.obj, messages)
    if where is None:
        return f"the model's chat template needs {name} of a value that does not have it"
    if isinstance(e.name, int):
        return f"the model's chat template needs {where}[{e.name}], which the request does not have"
    index = re.match(r"messages\[(\d+)\]", where)
    role = f" (a message with role {str(messages[int(index[1])].get('role'))[:64]!r})" if index else ""
    return f"the model's chat template needs {name} in {where}{role}, which it does not have"


def _path_to(target: Any, value: Any, path: str = "messages", depth: int = 4) -> str | None:
    """Where `target` (the object itself, not an equal one) sits in the messages, e.g. messages[2].tool_calls[0]."""
    if value is target:
        return path
    if depth == 0:
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _path_to(target, item, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}", depth - 1)
        if found is not None:
            return found
    return None


def load_chat_template(model_dir: str | Path, override: str | Path | None = None) -> ChatTemplate | None:
    """The template of `model_dir`, or None when it has none (chat then answers 400 / FAILED_PRECONDITION).
    transformers' places: tokenizer_config.json `chat_template` (a string, or a list of named templates:
    "default" is used), then chat_template.jinja beside it. `override` (--chat-template FILE, as vLLM's) is used
    instead; one that cannot be read or parsed is a ValueError (the server does not start)."""
    model_dir = Path(model_dir)
    config: dict[str, Any] = {}
    path = model_dir / "tokenizer_config.json"
    if path.is_file():
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            log.warning("%s: cannot be read (%s); chat completions are off", path, e)
            return None
    source = config.get("chat_template")
    if override is not None:
        path = Path(override)
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {path}: cannot be read ({e})") from None
    if isinstance(source, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is None and (model_dir / "chat_template.jinja").is_file():
        source = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    if not isinstance(source, str) or not source:
        return None
    special = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(name)
        if isinstance(value, dict):  # AddedToken as saved by transformers
            value = value.get("content")
        if isinstance(value, str):
            special[name] = value
    try:
        return ChatTemplate(source, special)
    except jinja2.exceptions.TemplateSyntaxError as e:
        if override is not None:
            raise ValueError(f"--chat-template {path}: does not parse ({e})") from None
        log.warning("%s: the chat template does not parse (%s); chat completions are off", path, e)
        return None


def render_chat(template: ChatTemplate | None, model: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
                extra: dict[str, Any] | None, instead: str, tools: list[dict[str, Any]] | None = None,
                field: str = "messages") -> str:
    """`messages` (OpenAI's, as dicts; either door's) as the model's template writes them, special tokens included
    (tokenize the text without adding them again). Refused: no template (FAILED_PRECONDITION, saying what to do
    `instead`), a content part other than text, or what the template refuses (INVALID_ARGUMENT on `field`)."""
    if template is None:
        raise FailedPrecondition(
            f"model {model!r} has no chat template (tokenizer_config.json has no chat_template); {instead}")
    rendered = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if any(not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str)
                   for part in content):
                raise InvalidArgument([FieldViolation(f"{field}[{i}].content",
                                                      "only text content parts are supported")])
            message = {**message, "content": "".join(part["text"] for part in content)}
        rendered.append(message)
    if tools:  # (transformers' apply_chat_template(tools=...): the template's `tools`)
        extra = {**(extra or {}), "tools": tools}
    try:
        return template.render(template_messages(rendered), add_generation_prompt, extra)
    except ChatTemplateError as e:
        raise InvalidArgument([FieldViolation(field, str(e))]) from None


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool calls with their arguments as objects, as templates write them (vLLM does the same)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            m = {**m, "tool_calls": [_with_object_arguments(c) for c in calls]}
        out.append(m)
    return out


def _with_object_arguments(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            return {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
        except ValueError:
            pass  # (the template gets the text as sent)
    return call
