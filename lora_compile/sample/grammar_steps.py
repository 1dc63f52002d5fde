"""A step's structured-output work within its budget (GrammarLimits.step_timeout_s).

Each step, the constrained sequences' next-token masks are computed before sampling (into one int32 bitmask on the
host, 32 tokens a word; `sample` applies it on the logits' device: one copy, no host synchronisation), and their
sampled tokens are consumed after it. Both are llguidance calls whose cost the request controls (its grammar), and
llguidance drops the GIL while it works. They run on a worker thread that the engine thread waits for at most the
step's budget: a sequence whose work is not done by then ends with a precise error, and its batch-mates carry on
(they waited the budget, once). A worker still busy with such a call is left to finish it and let the matcher go;
the next step gets a new worker. A matcher that fails (a limit of llguidance's own, hit in a step) ends its
sequence the same way.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import llguidance.torch as llg_torch
import torch

from .structured_output import GrammarError, GrammarLimits, in_our_words

if TYPE_CHECKING:
    from ..sequence import Sequence

log = logging.getLogger(__name__)


class GrammarSteps:
    def __init__(self, limits: GrammarLimits, vocab_size: int, pin: bool):
        self.limits = limits
        self.vocab_size = vocab_size
        self.pin = pin
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self.late = 0  # sequences ended for taking longer than the budget (tests, logs)

    def masks(self, seqs: list[Sequence]) -> tuple[torch.Tensor | None, dict[int, GrammarError]]:
        """(len(seqs), ceil(vocab / 32)) int32 on the host, bit t of row i set where sequence i may take token t
        (every bit of an unconstrained row), or None when no sequence is constrained; and the rows whose mask
        failed or was late, with why (their rows allow every token: their sampled token is not used)."""
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None and not s.is_finished]
        if not rows:
            return None, {}
        bitmask = torch.full(llg_torch.get_bitmask_shape(len(seqs), self.vocab_size), -1, dtype=torch.int32,
                             pin_memory=self.pin)
        done = self._run([lambda i=i: llg_torch.fill_next_token_bitmask(seqs[i].grammar, bitmask, i) for i in rows])
        failed = {}
        for n, i in enumerate(rows):
            problem = self._problem(seqs[i], n < done, "computing its next tokens")
            if problem is not None:
                failed[i] = problem
                bitmask[i] = -1
        return bitmask, failed

    def consume(self, pairs: list[tuple[Sequence, int]]) -> dict[int, str | GrammarError]:
        """Each constrained sequence's matcher takes its sampled token. By position in `pairs`: "stop" where its
        grammar has ended, a GrammarError where it failed, refused the token (only one the mask did not allow) or
        was late; absent where it goes on."""
        if not pairs:
            return {}
        accepted: dict[int, bool] = {}

        def take(n: int, seq: Sequence, token: int) -> None:
            accepted[n] = seq.grammar.consume_token(token)

        done = self._run([lambda n=n, s=s, t=t: take(n, s, t) for n, (s, t) in enumerate(pairs)])
        out: dict[int, str | GrammarError] = {}
        for n, (seq, token) in enumerate(pairs):
            problem = self._problem(seq, n < done, f"taking token {token}")
            if problem is None and not accepted.get(n, False):
                problem = GrammarError(f"structured output: the grammar refused token {token}")
            if problem is not None:
                out[n] = problem
            elif seq.grammar.is_stopped():
                out[n] = "stop"
        return out

    def _problem(self, seq: Sequence, finished: bool, what: str) -> GrammarError | None:
        if not finished:
            self.late += 1
            error = GrammarError(
                f"structured output: {what} took longer than the step's limit of {1000 * self.limits.step_timeout_s:g} "
                "ms (--structured-output-step-timeout): the grammar is too expensive to follow; simplify it")
        elif seq.grammar.is_error():
            error = GrammarError(f"structured output: {what} failed: {in_our_words(seq.grammar.get_error())}")
        else:
            return None
        log.info("sequence %d ended: %s", seq.seq_id, error)
        return error

    def _run(self, calls: list[Callable[[], None]]) -> int:
        """Run `calls` in order on the worker; how many finished within the step's budget."""
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-step")
        finished, stop = [0], threading.Event()

        def work() -> None:
            for call in calls:
                if stop.is_set():
                    return
                call()
                finished[0] += 1

        future = self._worker.submit(work)
        try:
            future.result(timeout=self.limits.step_timeout_s)
        except concurrent.futures.TimeoutError:
            stop.set()  # the call under way finishes on its own; the rest are not started
            self._worker.shutdown(wait=False)
            self._worker = None
        return finished[0]
