"""Soak: waves of hundreds of concurrent streams over loopback (base model and the three demo adapters with
two device slots, random cancels and deadlines, bursts past the queue limit) against the eager demo engine.

Every stream either completes with exactly its reference tokens (engine.generate of that request alone) or
ends with the status it was given: CANCELLED (it cancelled), DEADLINE_EXCEEDED (it had a deadline) or
RESOURCE_EXHAUSTED (refused before any work). A stream that ended early got a prefix of its reference: no
token lost or duplicated. Afterwards every slot is free and RSS is back near its baseline.
The figures are printed and written to .cache/reliability/soak.json.
"""
from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
import pytest

from service._proto import pb, pb_grpc
from service.limits import RequestLimits
from service.server import ServerConfig
from tests.client_loop import ClientLoop
from tests.service_harness import ServerThread, shared_engine, wait_for

ROOT = Path(__file__).resolve().parents[1]
REPORT_DIR = Path(os.environ.get("LORA_SERVE_RELIABILITY_DIR", ROOT / ".cache" / "reliability"))
WAVES = int(os.environ.get("LORA_SERVE_SOAK_WAVES", "4"))
STREAMS_PER_WAVE = int(os.environ.get("LORA_SERVE_SOAK_STREAMS", "250"))
MAX_NEW_TOKENS = 24
# RSS after vs before (after a warm-up wave): allocator arenas and grpc's buffers do not all go back to the
# OS, so some growth is normal; a leak of per-stream state (hundreds of streams x waves) would exceed this.
RSS_TOLERANCE_MB = 64
PROMPTS = ["Once upon a time", "The river", "In the morning the sun", "People in the town",
           "héllo wörld ✓", "Some of them have travelled"]
ADAPTERS = [None, "pirate", "poet", "scribe"]
C = grpc.StatusCode


@dataclass(frozen=True)
class Plan:
    prompt: str
    adapter: str | None
    n: int
    action: str                 # "complete", "cancel" or "deadline"
    delay: float                # start after this many seconds into the wave
    cancel_after: int = 0       # "cancel": after this many messages (0: after cancel_delay, maybe before any)
    cancel_delay: float = 0.0
    timeout: float | None = None


@dataclass
class Outcome:
    plan: Plan
    code: grpc.StatusCode
    tokens: list[int]
    finish_reason: int = 0
    completion_tokens: int = -1


def _plans(rng: random.Random, count: int) -> list[Plan]:
    plans = []
    for _ in range(count):
        common = dict(prompt=rng.choice(PROMPTS), adapter=rng.choice(ADAPTERS), n=rng.randint(4, MAX_NEW_TOKENS),
                      delay=rng.uniform(0, 2.0))
        r = rng.random()
        if r < 0.55:
            plans.append(Plan(action="complete", **common))
        elif r < 0.75:
            plans.append(Plan(action="cancel", cancel_after=rng.randint(0, 4), cancel_delay=rng.uniform(0, 0.3),
                              **common))
        else:
            plans.append(Plan(action="deadline", timeout=rng.uniform(0.05, 1.5), **common))
    return plans


async def _stream(stub: pb_grpc.GenerationStub, plan: Plan) -> Outcome:
    await asyncio.sleep(plan.delay)
    request = pb.GenerateRequest(text=plan.prompt, adapter=plan.adapter or "")
    request.stopping.max_new_tokens = plan.n
    request.stopping.ignore_eos = True
    call = stub.Generate(request, timeout=plan.timeout)
    out = Outcome(plan, C.OK, [])
    if plan.action == "cancel" and plan.cancel_after == 0:
        asyncio.get_running_loop().call_later(plan.cancel_delay, call.cancel)
    try:
        messages = 0
        async for msg in call:
            messages += 1
            out.tokens += msg.token_ids
            if msg.finish_reason:
                out.finish_reason, out.completion_tokens = msg.finish_reason, msg.usage.completion_tokens
            if plan.action == "cancel" and 0 < plan.cancel_after <= messages and not msg.finish_reason:
                call.cancel()
                break
    except grpc.aio.AioRpcError as e:
        out.code = e.code()
        return out
    except asyncio.CancelledError:  # grpc.aio raises this when the call was cancelled from our side
        if not call.cancelled():
            raise
    out.code = await call.code()
    return out


def _check(outcome: Outcome, reference: list[int]) -> None:
    plan, code, tokens = outcome.plan, outcome.code, outcome.tokens
    want = reference[:plan.n]
    assert tokens == want[:len(tokens)], f"{plan}: tokens are not a prefix of the reference"
    if code == C.OK:
        assert tokens == want and outcome.completion_tokens == plan.n, plan
        assert outcome.finish_reason == pb.FINISH_REASON_LENGTH, plan
    elif code == C.CANCELLED:
        assert plan.action == "cancel", plan
    elif code == C.DEADLINE_EXCEEDED:
        assert plan.action == "deadline", plan
    else:
        assert code == C.RESOURCE_EXHAUSTED and not tokens, (plan, code)


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.fixture(scope="module")
def served():
    # batch 8 + queue 96: a wave's burst overflows the queue now and then (RESOURCE_EXHAUSTED).
    server = ServerThread(shared_engine(), ServerConfig(port=0, grace_period_s=10, limits=RequestLimits(max_queue=96, retry_after_s=0.2)))
    yield server
    server.stop()


def test_soak(served):
    engine, runner = served.engine, served.server.runner
    tok = engine.tokenizer
    references = {(p, a): served.reference(tok.encode(p), a, MAX_NEW_TOKENS, ignore_eos=True)
                  for p in PROMPTS for a in ADAPTERS}
    rng = random.Random(20261122)
    counts: Counter = Counter()
    tokens_received = 0

    with ClientLoop() as client:
        async def channels():
            return [grpc.aio.insecure_channel(served.target) for _ in range(4)]
        chans = client.run(channels())
        stubs = [pb_grpc.GenerationStub(ch) for ch in chans]

        async def wave(plans: list[Plan]) -> list[Outcome]:
            return await asyncio.gather(*(_stream(stubs[i % len(stubs)], p) for i, p in enumerate(plans)))

        def run_wave(count: int, tally: bool) -> None:
            nonlocal tokens_received
            for outcome in client.run(wave(_plans(rng, count)), timeout=300):
                _check(outcome, references[outcome.plan.prompt, outcome.plan.adapter])
                if tally:
                    counts[outcome.plan.action, outcome.code.name] += 1
                    tokens_received += len(outcome.tokens)

        run_wave(40, tally=False)  # warm-up: grpc and allocator pools reach their working size
        served.wait_idle()
        wait_for(lambda: runner.num_open_streams == 0, what="every stream handler to end")
        gc.collect()
        before = dict(rss_mb=_rss_mb(), kv=engine.kv_cache.num_free_blocks, lora=engine.adapters.num_free_slots,
                      open_streams=runner.num_open_streams)
        t0 = time.perf_counter()
        rss_per_wave = []
        for _ in range(WAVES):
            run_wave(STREAMS_PER_WAVE, tally=True)
            rss_per_wave.append(round(_rss_mb(), 1))
        seconds = time.perf_counter() - t0
        served.wait_idle()
        wait_for(lambda: runner.num_open_streams == 0, what="every stream handler to end")
        for ch in chans:
            client.run(ch.close())
    gc.collect()
    after = dict(rss_mb=_rss_mb(), kv=engine.kv_cache.num_free_blocks, lora=engine.adapters.num_free_slots,
                 open_streams=runner.num_open_streams)

    by_status = Counter()
    for (_, code), n in counts.items():
        by_status[code] += n
    report = {
        "command": "python -m pytest " + " ".join(sys.argv[1:]),  # the run that wrote this
        "waves": WAVES, "streams": sum(counts.values()), "seconds": round(seconds, 1),
        "tokens_received": tokens_received, "by_status": dict(sorted(by_status.items())),
        "by_action_and_status": {f"{a} / {c}": n for (a, c), n in sorted(counts.items())},
        "before": {k: round(v, 1) for k, v in before.items()}, "after": {k: round(v, 1) for k, v in after.items()},
        "rss_after_each_wave_mb": rss_per_wave, "rss_tolerance_mb": RSS_TOLERANCE_MB,
    }
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    (REPORT_DIR / "soak.json").write_text(json.dumps(report, indent=2))
    print("\nsoak:", json.dumps(report, indent=2))

    assert by_status["OK"] > 0 and set(by_status) <= {"OK", "CANCELLED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}
    assert (after["kv"], after["lora"], after["open_streams"]) == (before["kv"], before["lora"], 0)
    assert after["rss_mb"] - before["rss_mb"] < RSS_TOLERANCE_MB, report
