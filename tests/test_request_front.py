"""The request front's one capacity check (service/front/front.py, service/runner/capacity.py), without an engine:
a call is checked once, for all its choices, before any of its prompts is tokenized; the places it was given are
held while it is prepared and go back when it is refused; and the refusals keep their words."""
from __future__ import annotations

import asyncio

import pytest

from service.errors import InvalidArgument, QueueFull, TooManyStreams
from service.front import GenerateParams, RequestFront
from service.limits import RequestLimits
from service.runner.capacity import Capacity, Reservation
from service.runner.request import ModelInfo

MODEL = ModelInfo(model="m", architecture="a", vocab_size=100, max_seq_len=64, max_num_seqs=4,
                  max_loras_per_batch=1, max_lora_rank=8, dtype="float32", device="cpu", compiled=False,
                  eos_token_ids=(2,), max_token_chars=8)


class FakeRunner:
    """What the front asks of the runner, in the order it asks."""

    def __init__(self, limits: RequestLimits, in_flight: int = 0):
        self.capacity, self.in_flight, self.calls = Capacity(MODEL.max_num_seqs, limits), in_flight, []

    def model_info(self) -> ModelInfo:
        return MODEL

    def reserve(self, choices: int = 1) -> Reservation:
        self.calls.append(("reserve", choices))
        return self.capacity.reserve(choices, self.in_flight, self.in_flight)

    def release(self, reservation: Reservation) -> None:
        self.capacity.release(reservation)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls.append(("encode", text))
        return [5] * len(text.split())

    def add_parent_request(self, requests, reservation):
        self.calls.append(("add", [r.n for r in requests]))
        self.capacity.release(reservation)
        return requests


def _submit(front: RequestFront, *params: GenerateParams):
    return asyncio.run(front.submit(list(params)))


def test_a_call_is_checked_once_for_all_its_choices_before_any_tokenizing():
    runner = FakeRunner(RequestLimits(max_queue=8))
    front = RequestFront(runner, RequestLimits(max_queue=8))
    _submit(front, GenerateParams(text="a b", n=2), GenerateParams(text="c", n=3))
    assert runner.calls == [("reserve", 5), ("encode", "a b"), ("encode", "c"), ("add", [2, 3])]
    assert runner.capacity.reserved == 0


def test_a_full_server_refuses_before_tokenizing_and_a_refused_call_gives_its_places_back():
    limits = RequestLimits(max_queue=2)
    runner = FakeRunner(limits, in_flight=6)  # 4 running, 2 queued: full
    with pytest.raises(QueueFull, match=r"^the waiting queue is full \(2 requests\); retry in 1s$"):
        _submit(RequestFront(runner, limits), GenerateParams(text="a", n=3))
    assert runner.calls == [("reserve", 3)]
    runner = FakeRunner(limits)
    with pytest.raises(InvalidArgument):  # an empty prompt: refused after its places were reserved
        _submit(RequestFront(runner, limits), GenerateParams(text="", n=2))
    assert runner.capacity.reserved == 0


def test_an_n_validation_refuses_counts_as_one_choice():
    runner = FakeRunner(RequestLimits(max_queue=0), in_flight=3)  # one place left
    with pytest.raises(InvalidArgument, match="n: must be in"):
        _submit(RequestFront(runner, RequestLimits(max_queue=0)), GenerateParams(text="a", n=99))
    assert runner.calls[0] == ("reserve", 1)


def test_capacity_words_and_held_places():
    capacity = Capacity(4, RequestLimits(max_queue=2))
    with pytest.raises(QueueFull, match=r"the 3 choices of this request need 3 places, 2 are left"):
        capacity.reserve(3, 4, 4)
    held = capacity.reserve(2, 4, 4)
    with pytest.raises(QueueFull, match=r"^the waiting queue is full \(2 requests\)"):  # held places count
        capacity.reserve(1, 4, 4)
    capacity.release(held)
    capacity.release(held)  # a no-op the second time
    assert capacity.reserved == 0
    streams = Capacity(4, RequestLimits(max_queue=2, max_concurrent_streams=5))
    with pytest.raises(TooManyStreams, match=r"too many open Generate streams \(limit 5\)"):
        streams.reserve(2, 4, 4)
