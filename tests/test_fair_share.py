"""One call's share (issue 52): a completions call with many prompts holds at most its share of the places in
flight (RequestLimits.max_request_share); its other prompts follow as these finish, so another tenant's request
arriving behind it is served meanwhile, not after it. Alone, the call takes the batch's free places (the share
keeps nothing empty). Through the real server and the OpenAI client."""
from __future__ import annotations

import threading
import time

import pytest

from service.limits import RequestLimits
from service.runner.reports import RunnerObserver
from service.server import ServerConfig
from tests.service_harness import ServerThread, build_engine, demo_paths, openai_client, wait_for

MAX_NUM_SEQS, MAX_QUEUE, PROMPTS = 8, 24, 24


class CallShares(RunnerObserver):
    """The most choices of one call in a step's batch, and queued or running, over every iteration."""

    def __init__(self) -> None:
        self.most_running = 0
        self.most_in_flight = 0

    def on_added(self, state) -> None:
        pass

    def on_iteration(self, result) -> None:
        per_call: dict[int, int] = {}
        for state in result.stepped:
            per_call[id(state.parent)] = per_call.get(id(state.parent), 0) + 1
            in_flight = sum(1 for s in state.parent.choices if s.queued and not s.done)
            self.most_in_flight = max(self.most_in_flight, in_flight)
        self.most_running = max([self.most_running, *per_call.values()])

    def on_finished(self, state) -> None:
        pass


@pytest.fixture(scope="module")
def served():
    limits = RequestLimits(max_queue=MAX_QUEUE)
    model, adapters = demo_paths()
    server = ServerThread(build_engine(model, {}, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=64),
                          ServerConfig(port=0, http_port=0, limits=limits, grace_period_s=5.0))
    yield server
    server.stop()


def test_a_call_of_many_prompts_leaves_room_for_others(served):
    running_cap, in_flight_cap = served.server.runner.limits.request_caps(MAX_NUM_SEQS)
    assert (running_cap, in_flight_cap) == (2, 8)
    shares = CallShares()
    runner = served.server.runner
    observer, runner.observer = runner.observer, shares
    model = served.engine.model_name
    big_done: list[float] = []
    try:
        def big() -> None:
            out = openai_client(served).completions.create(
                model=model, prompt=[f"Story number {i}:" for i in range(PROMPTS)], max_tokens=24,
                extra_body={"ignore_eos": True})
            assert len(out.choices) == PROMPTS and all(c.finish_reason == "length" for c in out.choices)
            big_done.append(time.perf_counter())

        caller = threading.Thread(target=big)
        caller.start()
        wait_for(lambda: runner.num_running > 0, what="the big call's first step")
        # Another tenant arrives behind 24 prompts: it is admitted beside the big call's share, not after it.
        t0 = time.perf_counter()
        stream = openai_client(served).completions.create(model=model, prompt="Hello", max_tokens=4, stream=True,
                                                          extra_body={"ignore_eos": True})
        first = None
        for _ in stream:
            first = first or time.perf_counter()
        victim_done = time.perf_counter()
        caller.join(120)
        assert big_done, "the big call did not finish"
        assert victim_done < big_done[0], "the other tenant waited for the whole call"
        assert first is not None and first - t0 < big_done[0] - t0
        # Alone at first, the call took the whole batch; it never held more than its share of the places in flight.
        assert shares.most_running == MAX_NUM_SEQS and shares.most_in_flight <= in_flight_cap
        assert runner.num_waiting == 0 and runner.num_running == 0
    finally:
        runner.observer = observer
    served.wait_idle()


def test_cancelling_a_paced_call_frees_everything(served):
    """A call cancelled while most of its prompts wait in its backlog: none of them is ever queued, nothing
    leaks (streams, KV blocks, sequences)."""
    runner = served.server.runner
    model = served.engine.model_name
    client = openai_client(served, timeout=0.5)
    with pytest.raises(Exception):  # the client gives up (a timeout) while the call is in progress
        client.completions.create(model=model, prompt=[f"Tale {i}:" for i in range(PROMPTS)], max_tokens=200,
                                  extra_body={"ignore_eos": True})
    wait_for(lambda: runner.num_open_streams == 0 and runner.num_waiting == 0 and runner.num_running == 0,
             timeout=30, what="the cancelled call to be swept")
    served.wait_idle()
