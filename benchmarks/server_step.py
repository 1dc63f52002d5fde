"""Where the service's latency overhead comes from: engine step time inside a running server vs bare.

    python -m benchmarks.server_step [--threads N] [--torch-in-main] [--no-gc-freeze] [--tokens 64] [--no-compile]
                                     [--model-size tiny]

An in-process lora-serve (compiled, SmolLM2-135M-shaped) streams 8 concurrent 64-token (--tokens) generations; every
engine.step is timed, with the gap between steps (scheduler + output processing that is not overlapped). Then the
same engine's bare decode step at batch 8 is measured in the same process, in the engine thread.

--torch-in-main builds the engine in the main thread (as the server did before service/runner/engine_thread.py), so
torch runs in two threads of the process. --no-gc-freeze undoes the server's gc.freeze() after warm-up.
The ITL percentiles include the in-process clients' own work, which a real client does elsewhere.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time

import torch

import service.runner.engine_thread as engine_thread
from benchmarks.common import add_model_size, decode_step_time, percentile, sized_checkpoint
from benchmarks.load import grpc_stream, open_loop
from lora_compile import Engine, EngineConfig
from service.client import AsyncLoraServeClient
from service.server import LoraServer, ServerConfig

BATCH = 8


class GcPauses:
    """Collections (generation, seconds) while active, from gc.callbacks."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self.active = False
        self._t0 = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self.active:
            self.pauses.append((info["generation"], time.perf_counter() - self._t0))

    def summary(self) -> str:
        full = [p for g, p in self.pauses if g == 2]
        worst = max((p for _, p in self.pauses), default=0.0)
        return (f"{len(self.pauses)} collections while streaming ({len(full)} full), "
                f"longest {1000 * worst:.1f} ms")


async def serve_and_stream(engine: Engine, gc_freeze: bool, gc_pauses: GcPauses, tokens: int = 64) -> list[float]:
    """Streams BATCH generations of `tokens` tokens; returns every inter-token gap the clients saw (s)."""
    server = LoraServer(engine, ServerConfig(port=0))
    await server.start()
    await server.warmup()
    if not gc_freeze:
        gc.unfreeze()
    gc_pauses.active = True
    async with AsyncLoraServeClient(f"127.0.0.1:{server.port}") as client:
        prompts = [[(7 * i + j) % 500 + 3 for j in range(64)] for i in range(BATCH)]
        records, _ = await open_loop(lambda prompt: grpc_stream(client, prompt, None, tokens), prompts, [0.0] * BATCH)
    gaps = [b - a for r in records for (a, _), (b, _) in zip(r.chunks, r.chunks[1:])]  # between messages
    gc_pauses.active = False
    await server.stop(grace_s=0)
    return gaps



def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--torch-in-main", action="store_true", help="build the engine in the main thread")
    p.add_argument("--no-gc-freeze", action="store_true", help="undo the server's gc.freeze() after warm-up")
    p.add_argument("--no-compile", action="store_true", help="an eager engine (no torch.compile: starts in seconds)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per stream (over 10 + the prefill steps: the "
                                                          "first and last 5 full-batch steps are not counted)")
    add_model_size(p)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        engine_thread.call(torch.set_num_threads, args.threads)
    config = EngineConfig(model=str(engine_thread.call(sized_checkpoint, args.model_size)), max_batch_size=BATCH,
                          max_seq_len=512, max_loras_per_batch=8, compile=not args.no_compile)
    engine = Engine(config) if args.torch_in_main else engine_thread.call(Engine, config)
    marks: list[tuple[float, float, int]] = []
    step = engine.step

    def timed(batch, **kwargs):
        t0 = time.perf_counter()
        out = step(batch, **kwargs)
        # the server's runner passes a scheduler's output (its batch: .scheduled); offline loops a list of sequences
        marks.append((t0, time.perf_counter(), len(getattr(batch, "scheduled", batch))))
        return out

    engine.step = timed
    gc_pauses = GcPauses()
    gaps = asyncio.run(serve_and_stream(engine, not args.no_gc_freeze, gc_pauses, args.tokens))
    engine.step = step
    full = [(a, b) for a, b, n in marks if n == BATCH][5:-5]  # steady decode at the full batch
    steps = [b - a for a, b in full]
    gap = statistics.median(full[i + 1][0] - full[i][1] for i in range(len(full) - 1))
    bare = statistics.median(engine_thread.call(decode_step_time, engine, BATCH, [None], 12)[0] for _ in range(3))
    where = "main and engine threads" if args.torch_in_main else "engine thread only"
    ms = lambda s: f"{1000 * s:.1f}"  # noqa: E731
    print(f"torch in the {where}, {torch.get_num_threads()} threads, gc.freeze {'off' if args.no_gc_freeze else 'on'}")
    print(f"bare decode step {ms(bare)} ms; in-server step P50 {ms(statistics.median(steps))} ms "
          f"({statistics.median(steps) / bare:.2f}x), P95 {ms(percentile(steps, 95))} ms; gap between steps {ms(gap)} ms")
    print(f"ITL seen by the clients: P50 {ms(statistics.median(gaps))} ms ({statistics.median(gaps) / bare:.2f}x bare), "
          f"P95 {ms(percentile(gaps, 95))} ms ({percentile(gaps, 95) / bare:.2f}x), P99 {ms(percentile(gaps, 99))} ms; "
          f"GC: {gc_pauses.summary()}")


if __name__ == "__main__":
    main()
