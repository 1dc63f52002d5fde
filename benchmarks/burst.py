"""A burst of concurrent streams: how long until every one has its first token, through the service vs the bare
engine on the same batch (issue 17's check: within 1.2x).

    python -m benchmarks.burst [--streams 8] [--rounds 5] [--dtype auto]

Starts `lora-serve` (compiled) on the SmolLM2-135M-shaped checkpoint and builds the same engine in this process
(it idles while the server runs, and the other way round). Each round sends `--streams` requests at once
(16-token prompts, 64 greedy tokens) through the gRPC SDK, then the same batch through the bare engine
(benchmarks.serving.replay_ttft, all arriving at 0); rounds alternate which goes first. Prints both times and their
ratio per round and the median.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess

from benchmarks.common import smollm2_checkpoint
from benchmarks.serving import one_request, replay_ttft
from benchmarks.serving import start_server as serving_server
from service.client import AsyncLoraServeClient

NEW_TOKENS = 64


def start_server(model, args) -> tuple[subprocess.Popen, str]:
    """The gRPC door only, a batch and a queue of `--streams`, no adapters (benchmarks.serving.start_server)."""
    load = argparse.Namespace(door="grpc", max_batch_size=args.streams, max_loras_per_batch=1, num_requests=args.streams,
                              max_num_batched_tokens=args.max_num_batched_tokens)
    proc, target, _ = serving_server(model, [], load, "--dtype", args.dtype)
    return proc, target


async def served_burst(target: str, prompts: list[list[int]]) -> float:
    async with AsyncLoraServeClient(target) as client:
        await one_request(client, [5, 6, 7], None, 2)  # connection set-up outside the measurement
        results = await asyncio.gather(*(one_request(client, p, None, NEW_TOKENS) for p in prompts))
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(errors[0])
    # each TTFT is from its own send; the sends are one event-loop turn apart
    return max(r.ttft for r in results)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model = smollm2_checkpoint()
    prompts = [[(7 * i + j) % 500 + 3 for j in range(16)] for i in range(args.streams)]
    proc, target = start_server(model, args)
    try:
        from lora_compile import Engine, EngineConfig
        engine = Engine(EngineConfig(model=str(model), dtype=args.dtype, max_batch_size=args.streams, max_seq_len=512,
                                     max_num_batched_tokens=args.max_num_batched_tokens))
        engine.warmup()
        specs = [(p, None, NEW_TOKENS) for p in prompts]
        print(f"{args.streams} streams, 16-token prompts, {NEW_TOKENS} tokens, dtype {engine.dtype}; "
              f"CPU: {os.cpu_count()} cores")
        ratios = []
        for r in range(args.rounds):
            order = ("service", "engine") if r % 2 == 0 else ("engine", "service")
            took = {}
            for who in order:
                took[who] = (asyncio.run(served_burst(target, prompts)) if who == "service"
                             else max(replay_ttft(engine, specs, [0.0] * len(specs))))
            ratios.append(took["service"] / took["engine"])
            print(f"round {r + 1}: all first tokens: service {1000 * took['service']:.1f} ms, "
                  f"engine {1000 * took['engine']:.1f} ms, service / engine {ratios[-1]:.2f}x", flush=True)
        print(f"median service / engine: {statistics.median(ratios):.2f}x")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
