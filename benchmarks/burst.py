"""A burst of concurrent streams: how long until every one has its first token, through the service vs the bare
engine on the same batch (issue 17's check: within 1.2x).

    python -m benchmarks.burst [--streams 8] [--rounds 5] [--dtype auto] [--tokens 64] [--no-compile]
                               [--model-size tiny]

Starts `lora-serve` (compiled) on the SmolLM2-135M-shaped checkpoint and builds the same engine in this process
(it idles while the server runs, and the other way round). Each round sends `--streams` requests at once
(16-token prompts, --tokens greedy tokens) through the gRPC SDK, then the same batch through the bare engine
(benchmarks.serving.replay_ttft, all arriving at 0); rounds alternate which goes first. Prints both times and their
ratio per round and the median.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics

from benchmarks.common import add_model_size, sized_checkpoint
from benchmarks.load import grpc_stream, open_loop
from benchmarks.serving import replay_ttft
from benchmarks.server import ServerProcess, lora_serve
from service.client import AsyncLoraServeClient


def start_server(model, args) -> ServerProcess:
    """The gRPC door only, a batch and a queue of `--streams`, no adapters."""
    return lora_serve(model, "--max-batch-size", str(args.streams), "--max-seq-len", "512",
                      "--max-loras-per-batch", "1", "--max-queue", str(args.streams),
                      "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                      "--dtype", args.dtype, *(["--no-compile"] if args.no_compile else []), http=False)


async def served_burst(target: str, prompts: list[list[int]], new_tokens: int) -> float:
    async with AsyncLoraServeClient(target) as client:
        await grpc_stream(client, [5, 6, 7], None, 2)  # connection set-up outside the measurement
        results, _ = await open_loop(lambda p: grpc_stream(client, p, None, new_tokens), prompts, [0.0] * len(prompts))
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
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per stream")
    p.add_argument("--no-compile", action="store_true", help="serve and build the engine eagerly (fast start)")
    add_model_size(p)
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model = sized_checkpoint(args.model_size)
    prompts = [[(7 * i + j) % 500 + 3 for j in range(16)] for i in range(args.streams)]
    server = start_server(model, args)
    try:
        from lora_compile import Engine, EngineConfig
        engine = Engine(EngineConfig(model=str(model), dtype=args.dtype, max_batch_size=args.streams, max_seq_len=512,
                                     max_num_batched_tokens=args.max_num_batched_tokens, compile=not args.no_compile))
        engine.warmup()
        specs = [(p, None, args.tokens) for p in prompts]
        print(f"{args.streams} streams, 16-token prompts, {args.tokens} tokens, dtype {engine.dtype}; "
              f"CPU: {os.cpu_count()} cores")
        ratios = []
        for r in range(args.rounds):
            order = ("service", "engine") if r % 2 == 0 else ("engine", "service")
            took = {}
            for who in order:
                took[who] = (asyncio.run(served_burst(server.target, prompts, args.tokens)) if who == "service"
                             else max(replay_ttft(engine, specs, [0.0] * len(specs))))
            ratios.append(took["service"] / took["engine"])
            print(f"round {r + 1}: all first tokens: service {1000 * took['service']:.1f} ms, "
                  f"engine {1000 * took['engine']:.1f} ms, service / engine {ratios[-1]:.2f}x", flush=True)
        print(f"median service / engine: {statistics.median(ratios):.2f}x")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
