"""Engine outputs → OpenAI response objects: one admitted call's answer, a JSON object or server-sent events.

A call has one choice per prompt × n, index prompt_index * n + i (OpenAI's and vLLM's order): a JSON answer lists
them by index; a stream sends each choice's outputs as they come, one choice per chunk, each with its index, and
ends after every choice has sent its last chunk. Usage sums the completion tokens of every choice and counts each
prompt once (OpenAI's usage for n > 1); cached_tokens: the prompt tokens choice 0 of each prompt read from the
prefix cache (its siblings read the rest of the prompt there too: parent_request.py).
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from fastapi.responses import JSONResponse

from service.errors import ServiceError
from service.front import ParentRequest, RequestFront, RequestOutput
from service.http_api.errors import classify, error_response, grpc_status
from service.http_api.logprobs import TextOffsets, chat_logprobs, completion_logprobs, vllm_prompt_logprobs
from service.http_api.prompts import prompt_list
from service.http_api.protocol import ChatCompletionRequest
from service.http_api.sse import DONE, event
from service.http_api.tool_calls import ToolPlan, answer, tool_finish_reason
from service.http_api.tool_stream import ToolCallStream, ToolDelta
from service.telemetry.http_tracing import HttpTracer

_FINISH = {"length": "length", "stop": "stop", "eos": "stop", "grammar": "stop", "cancelled": "abort"}  # abort: vLLM's word


def finish_reason(out: RequestOutput) -> str | None:
    return _FINISH.get(out.finish_reason) if out.finish_reason else None


def stop_reason(out: RequestOutput) -> str | int | None:
    """vLLM's extension: the stop string or stop token that ended the choice."""
    return out.stop if out.stop is not None else out.stop_token_id


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage; cached_tokens: prompt tokens whose KV the prefix cache held (included in prompt_tokens)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class Responder:
    """One admitted call's answer."""

    def __init__(self, front: RequestFront, tracer: HttpTracer | None, call: Any, parent: ParentRequest, body: Any,
                 model: str, tools: ToolPlan | None = None):
        self.front, self.tracer, self.call, self.parent = front, tracer, call, parent
        self.body, self.model = body, model
        self.requests = requests = parent.requests  # the call's prompts as prepared, one each
        self.tools = tools
        self._tool_streams: dict[int, ToolCallStream] = {}  # per choice, with tools
        self.chat = isinstance(body, ChatCompletionRequest)
        self.n = requests[0].n
        self.sampling = requests[0].sampling  # (every prompt's request has the same sampling fields)
        self.echo = not self.chat and body.echo
        # echo: each prompt as the client sent it (token ids: their text, special tokens left out as in outputs)
        self._echo_texts = [p if isinstance(p, str) else self._text(r.prompt_ids)
                            for p, r in zip(prompt_list(body.prompt), requests)] if self.echo else []
        self.created = int(time.time())
        self._offsets: dict[int, TextOffsets] = {}  # per choice, across chunks
        self._last: dict[int, RequestOutput] = {}   # each choice's last output: its usage
        self._closed = False
        self._error: Exception | None = None
        self._finished = False

    def close(self) -> None:
        """However the response ended: the runner forgets the call (a no-op once finished), the span ends."""
        if self._closed:
            return
        self._closed = True
        self.front.abort(self.parent)
        if self.tracer is not None:
            if self._error is not None:
                code, message = grpc_status(self._error)
                self.tracer.end(self.call, code, 200, message=message)
            elif self._finished:
                self.tracer.end(self.call, grpc.StatusCode.OK, 200)
            else:
                self.tracer.end(self.call, grpc.StatusCode.CANCELLED, 499, cancelled=True)

    async def collect(self) -> JSONResponse:
        totals: dict[int, RequestOutput] = {}
        try:
            while not self.parent.finished:
                out = await self.parent.next_output()
                if out.index in totals:
                    totals[out.index].merge(out)
                else:
                    totals[out.index] = out
        except ServiceError as exc:  # the engine failed a choice: its error, no partial answer
            self._error = exc
            return error_response(exc)
        self._finished = True
        self._last = totals
        choices = [self._choice(totals[i], first=True, whole=True) for i in sorted(totals)]
        body = {**self._head(), "choices": choices, "usage": self._usage()}
        if self.chat and self.sampling.prompt_logprobs is not None:  # vLLM's: the prompt's, once per response
            body["prompt_logprobs"] = self._prompt_logprobs(totals[0], 0)
        return JSONResponse(body, headers={"x-request-id": self.parent.request_id})

    async def events(self) -> AsyncIterator[bytes]:
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        started: set[int] = set()  # choices whose first chunk was sent
        while not self.parent.finished:
            try:
                out = await self.parent.next_output()
            except ServiceError as exc:  # mid-stream failure: an error event, then the end (as vLLM does)
                self._error = exc
                _, body, _ = classify(exc)
                yield event(body)
                yield DONE
                return
            if out.finished:
                self._last[out.index] = out
            if self.tools is not None:
                stream = self._tool_streams.setdefault(out.index, ToolCallStream(self.tools))
                for delta in stream.feed(out.text, out.finished):
                    choice = self._choice(out, first=out.index not in started, whole=False, delta=delta)
                    started.add(out.index)
                    yield event({**self._head(chunk=True), "choices": [choice]})
                continue
            choice = self._choice(out, first=out.index not in started, whole=False)
            started.add(out.index)
            yield event({**self._head(chunk=True), "choices": [choice]})
        self._finished = True
        if include_usage:
            yield event({**self._head(chunk=True), "choices": [], "usage": self._usage()})
        yield DONE

    # --- one choice ------------------------------------------------------------------------------------------
    def _choice(self, out: RequestOutput, first: bool, whole: bool,
                delta: ToolDelta | None = None) -> dict[str, Any]:
        """A choice of a JSON answer (whole: every output of the choice merged) or of a chunk; `first`: the
        choice's first (echo: the prompt comes first; chat: the role comes with the first token, as vLLM sends
        it, so that a client timing its first chunk times the first token). With tools, a chunk's `delta` is what
        ToolCallStream released; only its last carries the finish (and the output's logprobs ride the first)."""
        choice: dict[str, Any] = {"index": out.index}
        reason = finish_reason(out)
        if self.tools is not None and whole:
            content, calls = answer(self.tools, out.text)
            choice["message"] = {"role": "assistant", "content": content}
            if calls:
                choice["message"]["tool_calls"] = calls
                reason = tool_finish_reason(self.tools, reason)
            choice["logprobs"] = self._chat_logprobs(out) if self.sampling.logprobs else None
        elif delta is not None:
            choice["delta"] = ({"role": "assistant"} if first else {}) | delta.fields
            choice["logprobs"] = self._chat_logprobs(out) if self.sampling.logprobs and delta.first else None
            reason = tool_finish_reason(self.tools, reason, delta.called) if delta.last else None
        elif self.chat:
            if whole:
                choice["message"] = {"role": "assistant", "content": out.text}
            elif first:
                choice["delta"] = {"role": "assistant", "content": out.text}
            else:
                choice["delta"] = {"content": out.text} if out.text or not out.finished else {}
            choice["logprobs"] = self._chat_logprobs(out) if self.sampling.logprobs else None
        else:
            prompt_text = self._echo_texts[out.index // self.n] if self.echo and first else ""
            choice["text"] = prompt_text + out.text
            choice["logprobs"] = self._completion_logprobs(out, first) if self.sampling.logprobs else None
        choice["finish_reason"] = reason
        if whole or (out.finished and (delta is None or delta.last)):
            choice["stop_reason"] = stop_reason(out)
        if self.body.return_token_ids:
            choice["token_ids"] = out.token_ids
        if whole and not self.chat and self.sampling.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(out, out.index // self.n)
        return choice

    def _completion_logprobs(self, out: RequestOutput, first: bool) -> dict[str, Any]:
        prompt = out.index // self.n
        k = self.sampling.top_logprobs
        tokens, logprobs, tops = self.front.token_texts(out.token_ids), list(out.logprobs), list(out.top_logprobs)
        offsets = self._offsets.setdefault(
            out.index, TextOffsets(len(self._echo_texts[prompt]) if self.echo else 0)).feed(tokens)
        if self.echo and first:  # the prompt's tokens first; its first token has no log-probability
            prompt_ids = self.requests[prompt].prompt_ids
            prompt_tokens = self.front.token_texts(prompt_ids)
            offsets = TextOffsets().feed(prompt_tokens) + offsets
            tokens = prompt_tokens + tokens
            # (a choice cancelled before its first token has none: None, as for the first prompt token)
            missing = [None] * (len(prompt_ids) - 1 - len(out.prompt_logprobs))
            logprobs = [None, *out.prompt_logprobs, *missing] + logprobs
            tops = [None, *out.prompt_top_logprobs, *missing] + tops
        return completion_logprobs(tokens, logprobs, tops if k else None, offsets, self.front.token_texts)

    def _chat_logprobs(self, out: RequestOutput) -> dict[str, Any]:
        return chat_logprobs(self.front.token_texts(out.token_ids), out.logprobs, out.top_logprobs,
                             self.front.token_texts)

    def _prompt_logprobs(self, out: RequestOutput, prompt: int) -> list:
        return vllm_prompt_logprobs(self.requests[prompt].prompt_ids, out.prompt_logprobs, out.prompt_top_logprobs,
                                    self.front.token_texts)

    def _text(self, ids: list[int]) -> str:
        return b"".join(t.data for t in self.front.token_texts(ids) if not t.special).decode("utf-8", "replace")

    # --- the call --------------------------------------------------------------------------------------------
    def _usage(self) -> dict[str, Any]:
        firsts = [self._last.get(p * self.n) for p in range(len(self.requests))]
        return usage(sum(len(r.prompt_ids) for r in self.requests),
                     sum(out.completion_tokens for out in self._last.values()),
                     sum(out.cached_tokens for out in firsts if out is not None))

    def _head(self, chunk: bool = False) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.parent.request_id, "object": kind, "created": self.created, "model": self.model}
