"""ParentRequest: one call's choices as its handler reads them (vLLM's ParentRequest), and how a call fans out.

A call names one prompt or several (the completions door's prompt list), each with n choices: one sequence per
choice, index prompt_index * n + i (OpenAI's and vLLM's order). Choice i of a seeded request samples with seed + i
(modulo 2**64), as vLLM seeds its children, so choice i equals a lone request with that seed.

A prompt's choices share its prefill through the prefix cache: choice 0 is admitted first and its siblings are
held until its prompt's full blocks are computed and cached (it has sampled its first token), so they start
past them. The engine caches a block once a step has written it, so siblings admitted in the same step would
compute the prompt again. A request for prompt log-probabilities reads no cached block (each choice computes its
own), so its siblings are not held.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass, field

from service.errors import StreamStalled
from service.runner.request import GenerationRequest, RequestOutput
from service.runner.request_state import RequestState

log = logging.getLogger(__name__)
_SEED_MODULUS = 2**64  # seeds are uint64 on both doors


@dataclass(frozen=True)
class Choice:
    """One sequence of a call: its request (choice i's seed), its index, and the index of the choice whose
    prefill it waits for (None: admitted as soon as it can be)."""

    request: GenerationRequest
    index: int
    waits_for: int | None = None


def fan_out(requests: list[GenerationRequest], block_size: int, prefix_caching: bool) -> list[Choice]:
    """The choices of a call with these prompts (each request carries its n)."""
    choices: list[Choice] = []
    for request in requests:
        first = len(choices)
        # Only full blocks before the last prompt token can be read from the cache (the last is computed again).
        shares = (request.n > 1 and prefix_caching and (len(request.prompt_ids) - 1) // block_size > 0
                  and request.sampling.prompt_logprobs is None)
        for i in range(request.n):
            sampling = request.sampling
            if i and sampling.seed is not None:
                sampling = dataclasses.replace(sampling, seed=(sampling.seed + i) % _SEED_MODULUS)
            choices.append(Choice(dataclasses.replace(request, sampling=sampling), first + i,
                                  first if i and shares else None))
    return choices


@dataclass(eq=False)
class ParentRequest:
    """The handler's side of a call: the next output of any of its choices (each says its index), and the stall
    timer: once every choice has finished, its output waits `keep_finished_s` for the reader, after which the
    handler's pending send is ended (StreamStalled)."""

    request_id: str
    choices: list[RequestState]   # by index
    keep_finished_s: float = 60.0
    closed: bool = False          # the handler is gone (every choice closed)
    expired: bool = False         # the finished output was left unread for keep_finished_s
    _next: int = 0                # round robin: where the next scan starts, so no choice waits behind another
    _ended: int = 0               # choices whose last output the reader has taken
    _ready: asyncio.Event = field(default_factory=asyncio.Event)
    _write: asyncio.Future | None = None  # the handler's send in progress (see deliver)
    _expiry: asyncio.TimerHandle | None = None
    # Choices not queued yet: past the call's share of the runner's places (RequestLimits.max_request_share), they
    # follow as its queued ones finish (EngineRunner._refill).
    backlog: deque[RequestState] = field(default_factory=deque)
    # The call's prompts as the front prepared them, one request each (prompt i's choices are i * n .. i * n + n - 1):
    # what its answer reports beside the outputs (the prompt's tokens, usage, echo).
    requests: tuple[GenerationRequest, ...] = ()

    def __post_init__(self) -> None:
        for state in self.choices:
            state.parent = self

    @property
    def finished(self) -> bool:
        """The reader has taken every choice's last output."""
        return self._ended == len(self.choices)

    @property
    def done(self) -> bool:
        """Every choice has finished (its last output or error is pending or taken)."""
        return all(state.done for state in self.choices)

    async def next_output(self) -> RequestOutput:
        """The next output of any choice (output.index says which); raises the error a choice failed with."""
        while True:
            count = len(self.choices)
            for k in range(count):
                state = self.choices[(self._next + k) % count]
                item = state.take()
                if item is None:
                    continue
                self._next = (state.index + 1) % count
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    self._ended += 1
                return item
            self._ready.clear()
            await self._ready.wait()

    def notify(self) -> None:
        self._ready.set()

    def child_finished(self) -> None:
        if not self.closed and self._expiry is None and self.done:
            self._expiry = asyncio.get_running_loop().call_later(self.keep_finished_s, self._expire)

    def close(self) -> None:
        """The handler is gone: the stall timer (which holds this request) is not needed any more."""
        self.closed = True
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    async def deliver(self, write: Awaitable[None]) -> None:
        """Await the handler's send; once every choice has finished, at most until keep_finished_s is up."""
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
                    self.request_id, self.keep_finished_s)
        self.expired = True
        if self._write is not None:
            self._write.cancel()
