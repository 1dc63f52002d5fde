"""RequestState: one sequence (one choice of a request) between the runner and its stream handler: its outputs,
lifecycle events, and what admission needs to know about it."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lora_compile import Sequence
from service.runner.output import OutputProcessor
from service.runner.request import GenerationRequest, RequestEvent, RequestEventType, RequestOutput

if TYPE_CHECKING:
    from service.runner.parent_request import ParentRequest


@dataclass(eq=False)
class RequestState:
    """One choice from add_request to its last output.

    Slow readers never hold the batch: the sequence is stepped whatever its reader does, and what the reader has
    not taken yet is merged into one pending output (vLLM's RequestOutputCollector), bounded by max_new_tokens.
    Its KV blocks are freed when it finishes; the finished output then waits for the reader (ParentRequest's
    stall timer)."""

    request: GenerationRequest
    seq: Sequence
    processor: OutputProcessor
    index: int = 0          # the choice's index in its ParentRequest (prompt_index * n + i)
    parent: ParentRequest | None = None
    # The choice whose prefill computes this one's prompt: admission holds this one until that prompt's blocks
    # are in the prefix cache, so it reads them instead of computing them again (n > 1).
    waits_for: RequestState | None = None
    aborted: bool = False   # the client went away (cancel, deadline, stream closed)
    done: bool = False      # the last output (or an error) is pending
    closed: bool = False    # the handler is gone; no longer counted as an open stream
    queued: bool = False    # in the runner's queue or batch (a call's choices past its share wait in its backlog)
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
        if isinstance(item, RequestOutput):
            item.index = self.index
        if isinstance(self._pending, RequestOutput) and isinstance(item, RequestOutput):
            self._pending.merge(item)
        else:  # (an error replaces unread text: the stream ends with the error's status)
            self._pending = item
        self._ready.set()
        if self.parent is not None:
            self.parent.notify()

    def take(self) -> RequestOutput | Exception | None:
        """What is pending, without waiting (None: nothing)."""
        item, self._pending = self._pending, None
        self._ready.clear()
        return item

    async def next_output(self) -> RequestOutput:
        """This choice's next output (a caller reading one choice alone; the doors read the ParentRequest)."""
        await self._ready.wait()
        item = self.take()
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
        if self.parent is not None:
            self.parent.child_finished()

    def close(self) -> None:
        """The handler is gone."""
        self.closed = True
