"""Cancel storms: waves of 200 concurrent requests through both doors of a real `python -m service` process (the
tiny test model, two adapters), about 45 % of them cancelled at random points: gRPC streams by call.cancel(),
HTTP ones by closing the connection mid-stream or before a non-streamed answer. A cancelled request must leave
nothing behind. After each storm the server's in-flight gauges are back to 0, every request that was not cancelled
got all its tokens, and the server's resident memory after the last storm is within 5 % of its level after the
first measured one (a warm-up storm comes before them).
"""
from __future__ import annotations

import asyncio
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import grpc.aio
import openai
import pytest

from service._proto import pb, pb_grpc
from tests.checkpoints import write_chat_template
from tests.client_loop import ClientLoop
from tests.http_wire import metric_value, metrics

ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"lora-serve ready on \S+:(\d+) \(gRPC\) and http://\S+:(\d+)")
# A warm-up storm, then STORMS measured ones. The warm-up fills what a server keeps once it has seen a mix of batch
# shapes (oneDNN's primitive cache, the batch layouts, KV blocks touched for the first time): measured here, RSS
# went from 339-347 MB after the first storm to 351-355 MB after the third, then stayed in 353-357 MB for 37 more.
STORMS = int(os.environ.get("LORA_SERVE_CANCEL_STORMS", "3"))
REQUESTS = 200
CANCEL_SHARE = 0.45
RSS_GROWTH = 0.05  # RSS after the last measured storm vs after the first
PROMPTS = ["Once upon a time", "The river", "héllo wörld ✓", "People in the town"]
MODELS = ["tiny", "qv8", "all4"]  # the base model (its --served name is the directory's) and two adapters
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
pytestmark = pytest.mark.slow


class ServerProcess:
    """`python -m service` on free ports; its output is read in a thread (a full pipe would block it)."""

    def __init__(self, *args: str):
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service", "--no-compile", "--port", "0", "--http-port", str(_free_port()), *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=os.environ | {"PYTHONUNBUFFERED": "1"})
        self._ready = threading.Event()
        self.grpc_port = self.http_port = 0
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(90):
            self.proc.kill()
            raise AssertionError("server never became ready:\n" + "".join(self.lines))

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if m := READY.search(line):
                self.grpc_port, self.http_port = int(m.group(1)), int(m.group(2))
                self._ready.set()

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def in_flight(self) -> tuple[float, float, float]:
        """Requests running and waiting, and the share of KV blocks they hold (/metrics)."""
        samples = metrics(self.http_port)
        return tuple(metric_value(samples, f"lora_serve:{name}")
                     for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"))

    def stop(self) -> None:
        self.proc.terminate()  # (SIGTERM: a drain of an idle server)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _free_port() -> int:  # (--http-port 0 turns the HTTP door off)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(models, adapters, tmp_path_factory):
    model = tmp_path_factory.mktemp("storm-model") / "tiny"
    shutil.copytree(models["llama"], model)
    write_chat_template(model, CHAT_TEMPLATE)
    proc = ServerProcess("--model", str(model), "--dtype", "float32", "--max-seq-len", "128",
                         *(f"--adapter={name}={adapters['llama'][name]}" for name in MODELS[1:]))
    yield proc
    proc.stop()


async def _grpc(stub, rng: random.Random, n: int, cancel: bool) -> tuple[str, int]:
    model = rng.choice(MODELS)
    request = pb.GenerateRequest(text=rng.choice(PROMPTS), adapter="" if model == MODELS[0] else model)
    request.stopping.max_new_tokens, request.stopping.ignore_eos = n, True
    call = stub.Generate(request)
    after = rng.randint(0, n - 1) if cancel else n + 1  # tokens read before cancelling; 0: at a random moment
    if after == 0:
        asyncio.get_running_loop().call_later(rng.uniform(0, 0.2), call.cancel)
    tokens = 0
    try:
        async for msg in call:
            tokens += len(msg.token_ids)
            if tokens >= after:
                call.cancel()
                return "cancelled", tokens
    except asyncio.CancelledError:  # grpc.aio's answer to our own cancel
        return "cancelled" if cancel else "CancelledError", tokens
    except grpc.aio.AioRpcError as e:
        cancelled = cancel and e.code() is grpc.StatusCode.CANCELLED
        return "cancelled" if cancelled else f"{e.code().name}: {e.details()}", tokens
    return "ok", tokens


async def _http(client: openai.AsyncOpenAI, rng: random.Random, n: int, cancel: bool) -> tuple[str, int]:
    chat, stream, model, prompt = rng.random() < 0.5, rng.random() < 0.5, rng.choice(MODELS), rng.choice(PROMPTS)
    params = dict(model=model, max_tokens=n, stream=stream, extra_body={"ignore_eos": True})
    if stream:
        params["stream_options"] = {"include_usage": True}
    create = (client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **params) if chat
              else client.completions.create(prompt=prompt, **params))
    if not stream:
        try:  # cancelled: the client gives up waiting and closes its connection
            answer = await (asyncio.wait_for(create, rng.uniform(0.01, 0.3)) if cancel else create)
        except asyncio.TimeoutError:
            return "cancelled", 0
        return "ok", answer.usage.completion_tokens
    after = rng.randint(1, n)  # chunks read before closing the connection, when it cancels
    tokens = chunks = 0
    async with await create as events:  # leaving the block closes the connection
        async for chunk in events:
            chunks += 1
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if cancel and chunks >= after:
                return "cancelled", tokens
    return "ok", tokens


def test_cancel_storms_leave_nothing_behind(server):
    rng = random.Random(20261126)
    rss, tally = [], Counter()
    with ClientLoop() as loop:
        async def connect():
            channels = [grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") for _ in range(4)]
            # (the SDK's default retries: a pooled connection the server closes as idle just as a request goes
            # out is HTTP/1.1's keep-alive race, seen now and then in long runs on a loaded machine)
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused",
                                        max_retries=2, timeout=120)
            return channels, client
        channels, client = loop.run(connect())
        stubs = [pb_grpc.GenerationStub(c) for c in channels]

        async def storm() -> list[tuple[bool, int, tuple[str, int]]]:
            plans = [(i % 2 == 0, rng.randint(4, 16), rng.random() < CANCEL_SHARE) for i in range(REQUESTS)]
            results = await asyncio.gather(*(
                _grpc(stubs[i % len(stubs)], rng, n, cancel) if on_grpc else _http(client, rng, n, cancel)
                for i, (on_grpc, n, cancel) in enumerate(plans)))
            return [(cancel, n, result) for (_, n, cancel), result in zip(plans, results)]

        for i in range(1 + STORMS):
            for cancel, n, (outcome, tokens) in loop.run(storm(), timeout=600):
                tally[outcome] += 1
                # One cancelled too late is "ok"; one that was not cancelled got every token.
                complete = outcome == "ok" and tokens == n
                assert complete or cancel and outcome == "cancelled", (cancel, n, outcome, tokens)
            deadline = time.monotonic() + 60
            while (left := server.in_flight()) != (0, 0, 0):  # cancelled requests are swept within a step
                assert time.monotonic() < deadline, f"after storm {i}: (running, waiting, KV usage) = {left}"
                time.sleep(0.05)
            if i > 0:  # (storm 0 warms up)
                rss.append(round(server.rss_mb(), 1))
        for channel in channels:
            loop.run(channel.close())
        loop.run(client.close())
    print(f"\ncancel storms: {dict(tally)}; server RSS after each measured storm (MB): {rss}")
    assert tally["cancelled"] > 0.3 * (1 + STORMS) * REQUESTS, tally  # the storms did cancel
    assert rss[-1] <= rss[0] * (1 + RSS_GROWTH), f"server RSS grew from {rss[0]} to {rss[-1]} MB: {rss}"
