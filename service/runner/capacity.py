"""The places a call may take, checked once per call before any work on it (the request front checks before it
tokenizes): the batch and the waiting queue (--max-num-seqs + --max-queue) and the open streams
(--max-concurrent-streams), both RESOURCE_EXHAUSTED with RetryInfo when full.

The places a call is granted are held (a Reservation) while the front tokenizes and checks it, and pass to its
choices when the runner queues them, or back when the call is refused: calls prepared at the same time (a long
text in the tokenizer thread, a grammar compiling) cannot together overrun the queue, and no second check is
needed when the call is queued."""
from __future__ import annotations

from dataclasses import dataclass

from service.errors import QueueFull, TooManyStreams
from service.limits import RequestLimits


@dataclass(eq=False)
class Reservation:
    """Places held for one call, from its capacity check until its choices are queued or it is refused."""

    sequences: int
    held: bool = True


class Capacity:
    def __init__(self, max_num_seqs: int, limits: RequestLimits):
        self.max_num_seqs = max_num_seqs
        self.places = max_num_seqs + limits.max_queue  # in flight at once: the batch and the queue behind it
        self.max_streams = limits.max_concurrent_streams or self.places
        self.retry_after_s = limits.retry_after_s
        self.reserved = 0  # places held by calls still being prepared

    @property
    def max_request_sequences(self) -> int:
        """The most sequences (prompts x n) one call can ever be given: more is refused whatever the load."""
        return min(self.places, self.max_streams)

    def reserve(self, sequences: int, in_flight: int, open_streams: int) -> Reservation:
        """Places for `sequences` choices (each counts against the queue and as a stream), given the choices
        `in_flight` and the streams open now, or RESOURCE_EXHAUSTED. Counted against batch + queue, not the
        queue alone: a burst on an idle server is admitted at once. A full server says so plainly; a call that
        does not fit where one choice would is told how many places it needs and how many are left."""
        in_flight += self.reserved
        open_streams += self.reserved  # (open streams include finished ones flushing to slow readers)
        for needed in dict.fromkeys((1, sequences)):
            if in_flight + needed > self.places:
                raise QueueFull(max(0, in_flight - self.max_num_seqs), self.retry_after_s, needed,
                                max(0, self.places - in_flight))
            if open_streams + needed > self.max_streams:
                raise TooManyStreams(self.max_streams, self.retry_after_s)
        self.reserved += sequences
        return Reservation(sequences)

    def release(self, reservation: Reservation) -> None:
        """The call's places go back (refused) or pass to its queued choices (taken); a no-op the second time."""
        if reservation.held:
            reservation.held = False
            self.reserved -= reservation.sequences
