"""The one load loop of the benchmarks that drive a server: requests sent at given gaps (an open loop: Poisson
arrivals, or all at once) or by N workers, each taking the next request when its last one is done (a closed loop);
each request streamed and every chunk's arrival recorded as it comes.

A stream's record keeps each chunk's arrival time and token count, so every measure a benchmark reports derives
from the same data: time to first token, inter-token latency (a chunk of n tokens counts as n gaps of its gap / n,
the stream's pace as a client sees it), each token's arrival time.
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


@dataclass
class StreamRecord:
    adapter: str | None
    start: float                                                    # the clock at send
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens) of each chunk with tokens
    end: float = 0.0                                                # the clock when the stream ended
    error: str | None = None

    @property
    def output_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def ttft(self) -> float:
        return self.chunks[0][0] - self.start if self.chunks else math.nan

    @property
    def itl(self) -> list[float]:
        """The gaps between tokens after the first: a chunk of n tokens gives n gaps of (its gap / n)."""
        return [(b - a) / n for (a, _), (b, n) in zip(self.chunks, self.chunks[1:]) for _ in range(n)]

    @property
    def token_times(self) -> list[float]:
        """Each token's arrival (the tokens of one chunk arrive together)."""
        return [t for t, n in self.chunks for _ in range(n)]

    @property
    def latency(self) -> float:
        return self.end - self.start


def _finish(record: StreamRecord, clock: Callable[[], float]) -> StreamRecord:
    record.end = clock()
    if record.error is None and not record.chunks:  # ignore_eos and max_new_tokens >= 1: a token was due
        record.error = "the stream ended with no token"
    return record


async def grpc_stream(client, prompt: list[int], adapter: str | None, max_new: int,
                      clock: Callable[[], float] = time.perf_counter) -> StreamRecord:
    """One greedy request (ignore_eos) through the gRPC SDK (`client`: service.client.AsyncLoraServeClient)."""
    record = StreamRecord(adapter, clock())
    try:
        async for chunk in client.generate(prompt, adapter=adapter, max_new_tokens=max_new, ignore_eos=True):
            if chunk.token_ids:
                record.chunks.append((clock(), len(chunk.token_ids)))
    except Exception as exc:  # noqa: BLE001 - counted and reported, the run goes on
        record.error = f"{type(exc).__name__}: {exc}"
    return _finish(record, clock)


async def http_stream(client, prompt: list[int], adapter: str | None, max_new: int,
                      clock: Callable[[], float] = time.perf_counter) -> StreamRecord:
    """The same request through the OpenAI-compatible HTTP door (`client`: openai.AsyncOpenAI), a streamed
    completion of the same token ids, its chunks' token ids counted as the gRPC stream carries them."""
    record = StreamRecord(adapter, clock())
    try:
        stream = await client.completions.create(model=adapter or "", prompt=prompt, max_tokens=max_new,
                                                 temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True, "return_token_ids": True})
        async for chunk in stream:
            n = len(chunk.choices[0].model_extra.get("token_ids") or ()) if chunk.choices else 0
            if n:
                record.chunks.append((clock(), n))
    except Exception as exc:  # noqa: BLE001 - counted and reported, the run goes on
        record.error = f"{type(exc).__name__}: {exc}"
    return _finish(record, clock)


def poisson_gaps(rng: random.Random, rate: float, n: int) -> list[float]:
    """n waits between sends for Poisson arrivals at `rate` requests/s (0: all at once)."""
    return [rng.expovariate(rate) if rate > 0 else 0.0 for _ in range(n)]


def draw_adapter(rng: random.Random, names: list[str], zipf: float) -> str | None:
    """An adapter drawn uniform (zipf 0) or by Zipf popularity (the first name the most popular); None: none."""
    if not names:
        return None
    if zipf <= 0:
        return rng.choice(names)
    weights = [1 / (rank + 1) ** zipf for rank in range(len(names))]
    return rng.choices(names, weights)[0]


async def open_loop(send: Callable[[T], Awaitable], requests: Sequence[T], gaps: Sequence[float]) -> tuple[list, float]:
    """Send each request (`send(request)`, not awaited before the next) and wait its gap after it; (every result in
    order, seconds from the first send to the last result)."""
    tasks = []
    t0 = time.perf_counter()
    for request, gap in zip(requests, gaps, strict=True):
        tasks.append(asyncio.create_task(send(request)))
        if gap:
            await asyncio.sleep(gap)
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - t0


async def closed_loop(send: Callable[[T], Awaitable], requests: Sequence[T], concurrency: int) -> tuple[list, float]:
    """`concurrency` workers, each sending the next request once its last one is done; (every result in request
    order, seconds from the first send to the last result)."""
    results: list = [None] * len(requests)
    todo = iter(enumerate(requests))  # (one iterator shared: the event loop runs one worker at a time)

    async def worker() -> None:
        for i, request in todo:
            results[i] = await send(request)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    return results, time.perf_counter() - t0
