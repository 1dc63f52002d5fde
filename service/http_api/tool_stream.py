"""A chat choice with tools, streamed as OpenAI streams tool calls: a call's first delta carries its index, id,
type and function name, the next ones fragments of its arguments (service/http_api/tool_calls.py says when calls
are made).

- A named tool_choice streams its arguments as the model writes them.
- "required" holds the text back until the choice ends (its JSON list is only known to be whole then), then sends
  each call: id and name, then its arguments.
- "auto" streams content as it comes, holding back only what might begin a call (hermes: `<tool_call>` anywhere;
  llama3_json: an answer whose first character is `{`); from a call on, the rest is held and parsed when the
  choice ends (text that parses to no call is sent as content then).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from service.http_api.tool_calls import HERMES_START, LLAMA3_START, ToolPlan, answer, held_back, new_call


@dataclass
class ToolDelta:
    fields: dict[str, Any]   # the chunk's delta (content and/or tool_calls)
    first: bool = False      # the first delta of an engine output: it carries that output's logprobs
    last: bool = False       # the choice's last delta: it carries the finish
    called: bool = False     # (last only) the answer called a tool


@dataclass
class ToolCallStream:
    plan: ToolPlan
    _text: str = ""          # everything so far
    _sent: int = 0           # characters of _text sent as content (auto)
    _in_call: bool = False   # auto: a <tool_call> began
    _named_id: str | None = None
    _out: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, text: str, finished: bool) -> list[ToolDelta]:
        self._text += text
        if self.plan.mode == "named":
            deltas = self._named(text)
        elif self.plan.mode == "auto" and not self._in_call:
            deltas = self._auto_content()
        else:
            deltas = []
        if finished:
            deltas += self._finish()
        if deltas:
            deltas[0].first = True
        return deltas

    def _named(self, text: str) -> list[ToolDelta]:
        if self._named_id is None:
            call = new_call(self.plan.named, text)
            self._named_id = call["id"]
            return [ToolDelta({"tool_calls": [{"index": 0, **call}]})]
        return [ToolDelta({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})] if text else []

    def _auto_content(self) -> list[ToolDelta]:
        if self.plan.parser == "llama3_json":  # a call is the whole answer: decided by its first character
            head = self._text.lstrip().removeprefix(LLAMA3_START).lstrip()
            if not head:
                return []
            if head.startswith("{"):
                self._in_call = True
                return []
            chunk, self._sent = self._text[self._sent:], len(self._text)
            return [ToolDelta({"content": chunk})] if chunk else []
        start = self._text.find(HERMES_START, self._sent)
        if start >= 0:
            self._in_call = True
            end = start
        else:
            end = len(self._text) - held_back(self._text)
        chunk, self._sent = self._text[self._sent:end], max(self._sent, end)
        return [ToolDelta({"content": chunk})] if chunk else []

    def _finish(self) -> list[ToolDelta]:
        if self.plan.mode == "named":
            return [ToolDelta({}, last=True, called=True)]
        content, calls = answer(self.plan, self._text)
        deltas = []
        if self.plan.mode == "auto":
            if not calls and self._text[self._sent:]:  # (with calls: the text before them went out as it came)
                deltas.append(ToolDelta({"content": self._text[self._sent:]}))
        elif not calls and content:  # "required" cut short: its text as it is
            deltas.append(ToolDelta({"content": content}))
        for i, call in enumerate(calls):
            fn = call["function"]
            deltas.append(ToolDelta({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                                     "function": {"name": fn["name"], "arguments": ""}}]}))
            deltas.append(ToolDelta({"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]}))
        if not deltas:
            deltas.append(ToolDelta({}))
        deltas[-1].last, deltas[-1].called = True, bool(calls)
        return deltas
