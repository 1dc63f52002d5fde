"""RequestState: one request between the runner and its stream handler (outputs, lifecycle events, slow readers)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from lora_compile import Sequence
from service.errors import StreamStalled
from service.runner.output import OutputProcessor
from service.runner.request import GenerationRequest, RequestEvent, RequestEventType, RequestOutput

log = logging.getLogger(__name__)


@dataclass(eq=False)
class RequestState:
    """One request from add_request to its last output.

    Slow readers never hold the batch: the request is stepped whatever its reader does, and what the reader has
    not taken yet is merged into one pending output (vLLM's RequestOutputCollector), bounded by max_new_tokens.
    Its KV blocks are freed when it finishes; the finished output then waits `keep_finished_s` for the reader."""

    request: GenerationRequest
    seq: Sequence
    processor: OutputProcessor
    keep_finished_s: float = 60.0
    aborted: bool = False   # the client went away (cancel, deadline, stream closed)
    done: bool = False      # the last output (or an error) is pending
    closed: bool = False    # the handler is gone; no longer counted as an open stream
    _write: asyncio.Future | None = None  # the handler's send in progress (see deliver)
    _expiry: asyncio.TimerHandle | None = None  # armed when the request finishes, cancelled when the stream closes
    expired: bool = False  # the finished output was left unread for keep_finished_s
    # Append-only (the engine thread stamps admission while the loop may read): readers keep their own index.
    events: list[RequestEvent] = field(default_factory=list)
    # Adapter admission (admission.py): the host load it waits on, when it began waiting, the read's (start, end)
    # wall clock, and how many requests were admitted past it while it waited for a device slot.
    adapter_load: Any = None
    adapter_wait_ns: int | None = None
    adapter_read: tuple[int, int] | None = None
    overtaken: int = 0
    _pending: RequestOutput | Exception | None = None
    _ready: asyncio.Event = field(default_factory=asyncio.Event)

    def record_event(self, type: RequestEventType, time_ns: int | None = None, **fields: Any) -> None:
        self.events.append(RequestEvent(type, time.time_ns() if time_ns is None else time_ns, fields or None))

    def push(self, item: RequestOutput | Exception) -> None:
        if isinstance(self._pending, RequestOutput) and isinstance(item, RequestOutput):
            self._pending.merge(item)
        else:  # (an error replaces unread text: the stream ends with the error's status)
            self._pending = item
        self._ready.set()

    async def next_output(self) -> RequestOutput:
        await self._ready.wait()
        item, self._pending = self._pending, None
        self._ready.clear()
        if isinstance(item, BaseException):
            raise item
        return item

    def finish_with(self, item: RequestOutput | Exception) -> None:
        if self.done:
            return
        self.done = True
        if isinstance(item, RequestOutput):
            self.record_event(RequestEventType.FINISHED, finish_reason=item.finish_reason,
                              prompt_tokens=item.prompt_tokens, completion_tokens=item.completion_tokens,
                              cached_tokens=item.cached_tokens)
        else:
            self.record_event(RequestEventType.FINISHED, error=item)
        self.push(item)
        if not self.closed:
            self._expiry = asyncio.get_running_loop().call_later(self.keep_finished_s, self._expire)

    def close(self) -> None:
        """The handler is gone: the stall timer (which holds this state) is not needed any more."""
        self.closed = True
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    async def deliver(self, write: Awaitable[None]) -> None:
        """Await the handler's send; once the request has finished, at most until keep_finished_s is up."""
        if self.expired:
            raise StreamStalled(self.keep_finished_s)
        self._write = asyncio.ensure_future(write)
        try:
            await self._write
        except asyncio.CancelledError:
            if not self.expired or not self._write.cancelled():
                raise
            raise StreamStalled(self.keep_finished_s) from None
        finally:
            self._write = None

    def _expire(self) -> None:
        self._expiry = None
        if self.closed:
            return
        log.warning("request %s: the client left its finished output unread for %.0fs; ending the stream",
                    self.request.request_id, self.keep_finished_s)
        self.expired = True
        if self._write is not None:
            self._write.cancel()
