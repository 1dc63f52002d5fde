"""The model's chat template (tokenizer_config.json `chat_template`), rendered as transformers renders it: jinja2's
ImmutableSandboxedEnvironment (a template cannot reach Python internals or mutate what it is given), trim_blocks
and lstrip_blocks, `raise_exception` for templates that refuse a conversation, loop controls."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

log = logging.getLogger(__name__)


class ChatTemplateError(ValueError):
    """The template refused the conversation (raise_exception) or failed to render it."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson  # transformers' version: no HTML escaping
        env.globals["raise_exception"] = _raise_exception
        self._template = env.from_string(source)
        self._special = special_tokens  # bos_token, eos_token, ... as the template expects them

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               extra: dict[str, Any] | None = None) -> str:
        try:
            return self._template.render(**(extra or {}), **self._special, messages=messages,
                                         add_generation_prompt=add_generation_prompt)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(str(e)) from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:  # a message the template
            raise ChatTemplateError(f"{type(e).__name__}: {e}") from e           # did not expect


def load_chat_template(model_dir: str | Path) -> ChatTemplate | None:
    """The template of `model_dir`, or None when it has none (the chat endpoint then answers 400).
    transformers' places: tokenizer_config.json `chat_template` (a string, or a list of named templates:
    "default" is used), then chat_template.jinja beside it."""
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
        log.warning("%s: the chat template does not parse (%s); chat completions are off", path, e)
        return None
