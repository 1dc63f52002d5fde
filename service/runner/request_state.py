"""RequestState: one sequence (one choice of a request) between the runner and its stream handler: its outputs
and lifecycle events (what the scheduler needs of it is on its Sequence)."""
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
    done: bool = False      # the last output (or an error) is pending
    closed: bool = False    # the handler is gone; no longer counted as an open stream
    queued: bool = False    # handed to the scheduler (a call's choices past its share wait in its backlog)
    running: bool = False   # admitted and not preempted since, as the last step's SchedulerOutput said
    # Append-only (read by observers while the runner appends): readers keep their own index.
    events: list[RequestEvent] = field(default_factory=list)
    _pending: RequestOutput | Exception | None = None
    _ready: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def aborted(self) -> bool:
        """The client went away (cancel, deadline, stream closed), or the runner ended it: the scheduler drops its
        sequence at its next step (Sequence.aborted)."""
        return self.seq.aborted

    @aborted.setter
    def aborted(self, value: bool) -> None:
        self.seq.aborted = value

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
