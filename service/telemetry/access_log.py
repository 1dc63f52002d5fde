"""The access log: one line per HTTP request once its response has ended (a stream: sent in full, or the client
left), as uvicorn's that vLLM prints, plus what a generation used:

  127.0.0.1:50312 "POST /v1/completions HTTP/1.1" 200 adapter=pirate prompt_tokens=5 completion_tokens=8 latency=0.412s

`adapter=-` is the base model; a request that made no generation (health, metrics, a refusal) has no adapter
or token fields. An ASGI wrapper around the whole HTTP app writes the line (so refusals by the Host check, and
500s, are logged too). The adapter and tokens come from the runner's requests that the HTTP request added: the
runner reports each one to its observers in the adding call's context (RunnerObserver.on_added), where the
wrapper has left a record; the tokens are read from them when the response ends.
"""
from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from service.runner.request import RequestEventType

if TYPE_CHECKING:
    from service.runner.reports import IterationResult
    from service.runner.request_state import RequestState

log = logging.getLogger(__name__)


@dataclass
class _Exchange:
    """One HTTP request's runner requests (one per choice: n, or a list of prompts)."""

    requests: list[RequestState] = field(default_factory=list)


_EXCHANGE: contextvars.ContextVar[_Exchange | None] = contextvars.ContextVar("lora_serve_access", default=None)


class AccessLog:
    """The ASGI wrapper (`wrap`) and the RunnerObserver that tells it which runner requests an HTTP request made."""

    def __init__(self, skip_paths: Iterable[str] = ()):
        self.skip_paths = frozenset(skip_paths)  # vLLM's --disable-access-log-for-endpoints: probes, scrapes

    def wrap(self, app):
        return _AccessLogApp(app, self.skip_paths)

    # --- RunnerObserver --------------------------------------------------------------------------------
    def on_added(self, state: RequestState) -> None:
        exchange = _EXCHANGE.get()
        if exchange is not None:  # (None: a gRPC call, or a request on a skipped path)
            exchange.requests.append(state)

    def on_iteration(self, result: IterationResult) -> None:
        pass

    def on_finished(self, state: RequestState) -> None:
        pass


class _AccessLogApp:
    def __init__(self, app, skip_paths: frozenset[str]):
        self.app, self.skip_paths = app, skip_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.skip_paths:
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status: int | None = None

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        exchange = _Exchange()
        token = _EXCHANGE.set(exchange)
        try:
            await self.app(scope, receive, send_status)
        finally:
            _EXCHANGE.reset(token)
            if log.isEnabledFor(logging.INFO):
                log.info("%s", _line(scope, status, exchange, time.perf_counter() - start))


def _line(scope, status: int | None, exchange: _Exchange, seconds: float) -> str:
    client = scope.get("client")
    # The path as the client sent it (raw bytes: no decoding tricks; h11 refuses control characters in it).
    path = scope.get("raw_path") or scope["path"].encode()
    line = (f'{f"{client[0]}:{client[1]}" if client else "-"} "{scope["method"]} '
            f'{path.decode("ascii", "backslashreplace")} HTTP/{scope.get("http_version", "1.1")}" '
            f'{status if status is not None else "-"}')
    if exchange.requests:
        prompt = completion = 0
        for state in exchange.requests:
            if state.index % state.request.n == 0:  # a prompt's first choice: its n choices share it
                prompt += len(state.request.prompt_ids)
            finished = next((e.fields for e in state.events if e.type is RequestEventType.FINISHED and e.fields
                             and "completion_tokens" in e.fields), None)
            completion += finished["completion_tokens"] if finished else len(state.seq.output_ids)
        # (names follow lora_compile.lora.adapters.check_adapter_name; escaped all the same: one request, one line)
        adapter = (exchange.requests[0].request.adapter or "-").encode("unicode_escape").decode("ascii")
        line += f" adapter={adapter} prompt_tokens={prompt} completion_tokens={completion}"
    return f"{line} latency={seconds:.3f}s"
