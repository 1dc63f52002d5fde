"""Where the service's latency overhead comes from: engine step time inside a running server vs bare.

    python -m benchmarks.server_step [--threads N]

An in-process lora-serve (compiled, SmolLM2-135M-shaped) streams 8 concurrent 64-token generations; every
engine.step is timed, with the gap between steps (scheduler + output processing that is not overlapped). Then the
same engine's bare decode step at batch 8 is measured in the same process.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from benchmarks.common import decode_step_time, smollm2_checkpoint
from lora_compile import Engine, EngineConfig
from service.client import AsyncLoraServeClient
from service.server import LoraServer, ServerConfig

BATCH = 8


async def serve_and_stream(engine: Engine) -> None:
    server = LoraServer(engine, ServerConfig(port=0))
    await server.start()
    await server.warmup()
    async with AsyncLoraServeClient(f"127.0.0.1:{server.port}") as client:
        async def one(i: int) -> None:
            prompt = [(7 * i + j) % 500 + 3 for j in range(64)]
            async for _ in client.generate(prompt, max_new_tokens=64, ignore_eos=True):
                pass
        await asyncio.gather(*(one(i) for i in range(BATCH)))
    await server.stop(grace_s=0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(model=str(smollm2_checkpoint()), max_batch_size=BATCH, max_seq_len=512,
                                 max_loras_per_batch=8))
    marks: list[tuple[float, float, int]] = []
    step = engine.step

    def timed(seqs, **kwargs):
        t0 = time.perf_counter()
        out = step(seqs, **kwargs)
        marks.append((t0, time.perf_counter(), len(seqs)))
        return out

    engine.step = timed
    asyncio.run(serve_and_stream(engine))
    engine.step = step
    full = [(a, b) for a, b, n in marks if n == BATCH][5:-5]  # steady decode at the full batch
    in_server = statistics.median(b - a for a, b in full)
    gap = statistics.median(full[i + 1][0] - full[i][1] for i in range(len(full) - 1))
    bare = statistics.median(decode_step_time(engine, BATCH, [None], 12)[0] for _ in range(3))
    print(f"torch threads {torch.get_num_threads()}: in-server step {1000 * in_server:.1f} ms, gap between steps "
          f"{1000 * gap:.1f} ms; bare step {1000 * bare:.1f} ms (in-server / bare = {in_server / bare:.2f}x)")


if __name__ == "__main__":
    main()
