"""Tool calls on /v1/chat/completions, as OpenAI and vLLM answer them.

- `tools` reach the chat template (as transformers' `apply_chat_template(tools=...)`); an assistant message's
  `tool_calls` reach it with their `arguments` as objects (OpenAI clients send JSON text; templates expect what
  they wrote), `role: "tool"` messages as sent.
- `tool_choice`:
  - "none": the tools are in the prompt, the answer is text;
  - unset with tools: "auto" where the server has a `--tool-call-parser`, else "none" (vLLM refuses "auto"
    without one; an unset choice is not refused, so a client that always sends its tools still works);
  - "auto": free text, then the parser's calls (hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
    blocks, as Qwen2.5/Qwen3 and Hermes templates ask for, the text before the first call being the content;
    llama3_json: an answer that is `{"name": ..., "parameters": {...}}` objects, `;`-separated, after an optional
    `<|python_tag|>`, as Llama 3.1-3.3 templates ask for);
  - "required": the output is held to a JSON list of calls, each a tool's name and parameters valid for it
    (vLLM's form), so it always parses;
  - {"type": "function", "function": {"name": N}}: the output is held to N's parameters; it is the arguments.
- Answers carry `tool_calls` (id, type, function name and arguments as JSON text) and finish_reason
  "tool_calls" ("auto" and "required"; a named choice answers "stop", as OpenAI does).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from service.errors import FieldViolation, InvalidArgument

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
HERMES_START = "<tool_call>"


@dataclass(frozen=True)
class ToolPlan:
    mode: str                                  # "auto", "required" or "named" ("none" needs no plan)
    names: tuple[str, ...]                     # the tools' names
    constraint: tuple[str, str] | None = None  # the structured output that forces the calls
    named: str | None = None
    parser: str | None = None                  # "auto": how calls are read from the text


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None,
               parser: str | None) -> ToolPlan | None:
    """The request's tools checked, and what the answer must do with them (None: plain text). Raises
    InvalidArgument naming the field."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidArgument([FieldViolation("tool_choice", "needs tools: send the functions it may call")])
        return None
    params = _check_tools(tools)
    choice = tool_choice if tool_choice is not None else ("auto" if parser else "none")
    if choice == "none":
        return None
    if choice == "auto":
        if parser is None:
            raise InvalidArgument([FieldViolation("tool_choice", (
                "\"auto\" needs a tool call parser: start the server with --tool-call-parser hermes (or send "
                "tool_choice \"required\" or a named function, which need none)"))])
        return ToolPlan("auto", tuple(params), parser=parser)
    if choice == "required":
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
             "properties": {"name": {"enum": [name]}, "parameters": schema}} for name, schema in params.items()]}}
        if parallel is False:
            calls["maxItems"] = 1
        return ToolPlan("required", tuple(params), ("json", json.dumps(calls)))
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in params:
            raise InvalidArgument([FieldViolation("tool_choice.function.name", (
                f"{str(name)[:64]!r} is not one of the tools ({', '.join(params)})"))])
        return ToolPlan("named", tuple(params), ("json", json.dumps(params[name])), named=name)
    raise InvalidArgument([FieldViolation("tool_choice", (
        "must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}"))])


def _check_tools(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each tool's name → its parameters schema (an object with no properties where it has none)."""
    if len(tools) > MAX_TOOLS:
        raise InvalidArgument([FieldViolation("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")])
    params: dict[str, dict[str, Any]] = {}
    bad = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            bad.append(FieldViolation(f"tools[{i}]", "must be {\"type\": \"function\", \"function\": {...}}"))
            continue
        name, schema = fn.get("name"), fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            bad.append(FieldViolation(f"tools[{i}].function.name", "must be 1-64 letters, digits, '_' or '-'"))
        elif name in params:
            bad.append(FieldViolation(f"tools[{i}].function.name", f"{name!r} is named twice"))
        elif not isinstance(schema, dict):
            bad.append(FieldViolation(f"tools[{i}].function.parameters", "must be a JSON schema object"))
        else:
            params[name] = schema
    if bad:
        raise InvalidArgument(bad)
    return params


def new_call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def answer(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished choice's text."""
    if plan.mode == "named":
        return None, [new_call(plan.named, text)]
    if plan.mode == "required":
        try:
            calls = json.loads(text)
        except ValueError:  # cut short by max_tokens: the text as it is
            return text, []
        return None, [new_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]
    return PARSERS[plan.parser](text, plan.names)


def parse_hermes(text: str, names: tuple[str, ...]) -> tuple[str | None, list[dict[str, Any]]]:
    """Hermes-style calls: each `<tool_call>` block a JSON object with a tool's `name` and its `arguments`. A block
    that is not such an object leaves the whole text as content (as vLLM's parser does)."""
    start = text.find(HERMES_START)
    if start < 0:
        return text, []
    calls = []
    for block in _HERMES.findall(text[start:]):
        try:
            call = json.loads(block)
        except ValueError:
            return text, []
        if not isinstance(call, dict) or call.get("name") not in names:
            return text, []
        args = call.get("arguments", {})
        calls.append(new_call(call["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
    if not calls:
        return text, []
    content = text[:start].strip()
    return content or None, calls


def parse_llama3_json(text: str, names: tuple[str, ...]) -> tuple[str | None, list[dict[str, Any]]]:
    """Llama 3.x's JSON calls: the whole answer is `{"name": ..., "parameters": {...}}` objects separated by `;`
    (vLLM's llama3_json), after an optional <|python_tag|> (a special token: left out of the text anyway). Anything
    else, or an object that is not such a call, leaves the text as content."""
    rest = text.strip().removeprefix(LLAMA3_START).lstrip()
    if not rest.startswith("{"):
        return text, []
    decoder, calls = json.JSONDecoder(), []
    while rest:
        try:
            call, end = decoder.raw_decode(rest)
        except ValueError:
            return text, []
        args = call.get("parameters", call.get("arguments")) if isinstance(call, dict) else None
        if call.get("name") not in names or not isinstance(args, dict):
            return text, []
        calls.append(new_call(call["name"], json.dumps(args, ensure_ascii=False)))
        rest = rest[end:].lstrip().removeprefix(";").lstrip()
    return None, calls


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}
LLAMA3_START = "<|python_tag|>"


def held_back(text: str) -> int:
    """How many trailing characters of streamed text might begin a `<tool_call>` (held until they tell)."""
    for k in range(min(len(HERMES_START) - 1, len(text)), 0, -1):
        if HERMES_START.startswith(text[-k:]):
            return k
    return 0


def tool_finish_reason(plan: ToolPlan, reason: str | None, called: bool = True) -> str | None:
    """OpenAI's: "tool_calls" once an "auto" or "required" answer called a tool and ended by itself."""
    return "tool_calls" if called and reason == "stop" and plan.mode in ("auto", "required") else reason
