"""One request's phases, read from the lifecycle events the runner stamped on it (service/runner/request.py), as
vLLM's RequestStateStats and FinishedRequestStats define them (vllm/v1/metrics/stats.py):

  queue     queued → first admission (readmissions after a preemption are not a new queue phase)
  prefill   first admission → first token
  decode    first token → last token
  inference first admission → last token
  e2e       queued → last token

The last token's time is the end of the step that sampled it when the caller tracked it (the token gaps of
inter-token latency), else when the request was finished. Reading never changes the request.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from service.runner.request import RequestEventType

if TYPE_CHECKING:
    from service.runner.request_state import RequestState


@dataclass(frozen=True)
class RequestTimes:
    queued_ns: int | None = None
    admitted_ns: int | None = None      # first admission
    first_token_ns: int | None = None
    finished_ns: int | None = None      # the FINISHED event: the last output, or the error
    finish_reason: str | None = None    # "length", "stop", "eos"; None: failed, cancelled or not finished
    failed: bool = False                # ended with an error
    aborted: bool = False               # the client went away first
    cached_tokens: int = 0              # prompt tokens found in the prefix cache

    @classmethod
    def of(cls, state: RequestState) -> RequestTimes:
        fields: dict = {}
        for event in list(state.events):  # (append-only; the engine thread may add one meanwhile)
            kind, at = event.type, event.time_ns
            if kind is RequestEventType.QUEUED:
                fields.setdefault("queued_ns", at)
            elif kind is RequestEventType.ADMITTED:
                fields.setdefault("admitted_ns", at)
            elif kind is RequestEventType.FIRST_TOKEN:
                fields.setdefault("first_token_ns", at)
            elif kind is RequestEventType.FINISHED:
                done = event.fields or {}
                fields.update(finished_ns=at, finish_reason=done.get("finish_reason"), failed="error" in done,
                              cached_tokens=done.get("cached_tokens", 0))
            elif kind is RequestEventType.ABORTED:
                fields["aborted"] = True
        return cls(**fields)

    @property
    def outcome(self) -> str | None:
        """How it ended, in our finish-reason words: "length", "stop", "eos", "cancelled"; None: it failed."""
        if self.finish_reason is not None:
            return self.finish_reason
        return "cancelled" if self.aborted and not self.failed else None

    @staticmethod
    def seconds(start_ns: int | None, end_ns: int | None) -> float | None:
        """end - start in seconds; None when either is unknown (the phase did not happen)."""
        if start_ns is None or end_ns is None:
            return None
        return max(0, end_ns - start_ns) / 1e9
