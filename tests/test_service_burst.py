"""Burst admission: requests that reach an idle server together get their first tokens from one engine step."""
from __future__ import annotations

import asyncio

import pytest

from lora_compile import SamplingParams
from service.runner import engine_runner, engine_thread
from service.runner.request import GenerationRequest, RequestEventType
from service.runner.engine_runner import EngineRunner
from tests.conftest import build_engine


@pytest.fixture(scope="module")
def engine(models):
    return engine_thread.call(lambda: build_engine(models["llama"], compile=False))


def _first_token_ns(state) -> int:
    return next(e.time_ns for e in state.events if e.type is RequestEventType.FIRST_TOKEN)


def test_burst_on_idle_runner_shares_one_prefill_step(engine, monkeypatch):
    """Each request is added one event-loop turn after the previous (as concurrent RPCs reach the runner): the
    runner, woken by the first, still admits all of them into its first step. The gap the runner waits for is
    widened: on a loaded machine one loop turn of this test can outlast the served 2 ms (the logic is under test,
    not this machine's speed), and the burst still ends at once when the batch is full."""
    monkeypatch.setattr(engine_runner, "_BURST_GAP_S", 1.0)
    monkeypatch.setattr(engine_runner, "_BURST_MAX_S", 10.0)
    n = engine.config.max_batch_size
    prompts = [[3 + i, 17, 29 + i, 5] for i in range(n)]

    async def run() -> list:
        runner = EngineRunner(engine)
        await runner.start()
        states = []
        for i, prompt in enumerate(prompts):
            req = GenerationRequest(f"r{i}", prompt, SamplingParams(max_new_tokens=3, ignore_eos=True))
            states.append(runner.add_request(req))
            await asyncio.sleep(0)
        for state in states:
            while not (await state.next_output()).finished:
                pass
        await runner.shutdown()
        return states

    states = asyncio.run(run())
    # One step stamps one end time on every first token it sampled.
    assert len({_first_token_ns(s) for s in states}) == 1
    expected = engine_thread.call(engine.generate, prompts, SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert [s.seq.output_ids for s in states] == expected
