"""Tracing overhead: steady decode throughput through the gRPC server, tracing off vs on, and the per-step
batch-init share read back from the exported engine.step spans.

    python -m benchmarks.tracing [--batch 32] [--new-tokens 48] [--rounds 3] [--adapters 4] [--no-compile]
                                 [--model-size tiny]

With many short rounds (e.g. --rounds 60 --new-tokens 16; more than 15 minutes on 2 cores) the paired on/off
ratios give a confidence interval of the overhead narrower than one round's noise.

Two servers share one engine (SmolLM2-135M-shaped, benchmarks.engine's limits) and take turns: off, on,
off, on, ... "On" exports spans and metrics over OTLP/gRPC to an in-process receiver, so building and
exporting spans is inside the measurement and the network is not. Requests cycle through the base model
and rank-16 adapters on all projections.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import threading
import time
from pathlib import Path

import grpc.aio
import torch

import service.runner.engine_thread as engine_thread
from benchmarks.common import add_model_size, proc_stat, sized_checkpoint, write_lora_adapter
from benchmarks.engine import LIMITS
from lora_compile import Engine, EngineConfig
from service._proto import pb, pb_grpc
from service.server import LoraServer, ServerConfig
from service.telemetry.setup import setup_telemetry
from service.tools.otlp_receiver import GrpcReceiver, OtlpSink
from service.tools.trace_summary import batch_init_share, format_step_stats, step_times

PROMPT_LEN = 32


async def decode_throughput(port: int, batch: int, new_tokens: int, adapters: list[str | None]) -> float:
    """Tokens/s streamed once every request has its first token (all `batch` decode together)."""
    firsts: list[float] = []
    arrivals: list[tuple[float, int]] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def one(i: int) -> None:
            req = pb.GenerateRequest(adapter=adapters[i % len(adapters)] or "")
            req.token_ids.ids.extend((7 * i + j) % 500 + 3 for j in range(PROMPT_LEN))
            req.stopping.max_new_tokens = new_tokens
            req.stopping.ignore_eos = True
            first = True
            async for msg in stub.Generate(req):
                now = time.perf_counter()
                if first:
                    firsts.append(now)
                    first = False
                else:
                    arrivals.append((now, len(msg.token_ids)))

        await asyncio.gather(*(one(i) for i in range(batch)))
    start = max(firsts)
    after = [(t, n) for t, n in arrivals if t > start]
    return sum(n for _, n in after) / (max(t for t, _ in after) - start)


def _time_span_building(observer) -> list:
    """Wrap TelemetryObserver.on_iteration (the per-step tracing work on the event loop): [seconds, calls]."""
    spent = [0.0, 0]
    inner = observer.on_iteration

    def timed(*args) -> None:
        t0 = time.perf_counter()
        inner(*args)
        spent[0] += time.perf_counter() - t0
        spent[1] += 1

    observer.on_iteration = timed
    return spent


def sdk_thread_cpu_s() -> float:
    """CPU seconds used so far by the OpenTelemetry SDK's own threads (span batching and export, metric
    export): /proc's per-thread utime + stime, in clock ticks."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for thread in threading.enumerate():
        if thread.name.startswith("Otel") and thread.native_id is not None:
            stat = proc_stat(f"/proc/self/task/{thread.native_id}/stat")
            total += stat[1] if stat else 0
    return total / tick


def bootstrap_ci(values: list[float], resamples: int = 10000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the mean."""
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(resamples))
    return means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


async def run(args: argparse.Namespace) -> None:
    def setup() -> tuple[Engine, list[str | None]]:  # in the engine thread, as a server runs it
        model = sized_checkpoint(args.model_size)
        engine = Engine(EngineConfig(model=str(model), compile=not args.no_compile, **LIMITS))
        for i in range(args.adapters):
            path = write_lora_adapter(model, model.parent / f"lora-r16-{i}", rank=16, seed=100 + i)
            engine.adapters.register(f"lora{i}", str(path))
        return engine, [None, *(f"lora{i}" for i in range(args.adapters))]

    engine, adapters = engine_thread.call(setup)
    model = Path(engine.config.model)

    sink = OtlpSink()
    receiver = GrpcReceiver(sink)
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint
    os.environ["OTEL_EXPORTER_OTLP_PROTOCOL"] = "grpc"
    os.environ.setdefault("OTEL_SERVICE_NAME", "lora-serve-bench")
    telemetry = setup_telemetry()
    off = LoraServer(engine, ServerConfig(port=0))
    on = LoraServer(engine, ServerConfig(port=0), telemetry)
    loop_cost = _time_span_building(on.observer)
    for server in (off, on):
        await server.start()
    t0 = time.perf_counter()
    for server in (off, on):
        await server.warmup()  # the engine compiles once; the second is a no-op that flips health
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {model.name} "
          f"({'eager' if args.no_compile else 'compiled'}, warm-up {time.perf_counter() - t0:.0f}s); "
          f"batch {args.batch}, prompt {PROMPT_LEN}, {args.new_tokens} new tokens; "
          f"base + {args.adapters} rank-16 adapters", flush=True)

    results: dict[str, list[float]] = {"off": [], "on": []}
    sdk_cpu_start = sdk_thread_cpu_s()
    try:
        for r in range(args.rounds + 1):  # round 0 warms up caches and is dropped
            # Alternate which goes first, so a drift within a round does not favour either.
            order = (("off", off), ("on", on)) if r % 2 else (("on", on), ("off", off))
            for name, server in order:
                tput = await decode_throughput(server.port, args.batch, args.new_tokens, adapters)
                if r:
                    results[name].append(tput)
        await asyncio.to_thread(telemetry.force_flush)
        sdk_cpu = sdk_thread_cpu_s() - sdk_cpu_start
    finally:
        for server in (off, on):
            await server.stop()
    t_off, t_on = statistics.median(results["off"]), statistics.median(results["on"])
    print(f"decode tok/s, median of {args.rounds} interleaved rounds: tracing off {t_off:.1f}, "
          f"on {t_on:.1f} ({100 * (t_on - t_off) / t_off:+.1f}%)")
    # One round's noise (another process, a page fault) hits its off and on runs alike: compare them pairwise.
    ratios = [on_ / off_ for off_, on_ in zip(results["off"], results["on"])]
    low, high = bootstrap_ci(ratios)
    print(f"paired on/off throughput over {len(ratios)} rounds: mean {statistics.mean(ratios):.4f}, "
          f"median {statistics.median(ratios):.4f}, 95% CI of the mean [{low:.4f}, {high:.4f}] "
          f"-> change {100 * (statistics.mean(ratios) - 1):+.1f}% (CI {100 * (low - 1):+.1f}% .. {100 * (high - 1):+.1f}%)")
    seconds, calls = loop_cost
    mean_step = statistics.mean(s.total for s in step_times(sink.spans()))
    print(f"building spans on the event loop after each step: {1e6 * seconds / calls:.0f} us per step "
          f"({calls} steps; {100 * seconds / calls / mean_step:.2f}% of the mean step)")
    # Work on another thread costs the step at most its own length (a GEMM thread it preempts stalls the
    # other at the next barrier), so span building + export CPU per step, over the step, bounds the slowdown.
    export = sdk_cpu / calls
    print(f"exporting on the SDK's threads: {1e6 * export:.0f} us CPU per step; tracing work per step "
          f"{1e6 * (seconds / calls + export):.0f} us = {100 * (seconds / calls + export) / mean_step:.2f}% of the "
          f"mean step (the in-process receiver's work, a collector's elsewhere, not counted)")
    steps = step_times(sink.spans(), batch_size=args.batch)
    print(f"\nengine.step spans at batch {args.batch}, as received over OTLP "
          f"(batch-init share {100 * batch_init_share(steps):.1f}%):")
    print(format_step_stats(steps))
    telemetry.shutdown()
    receiver.stop()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; medians are reported")
    p.add_argument("--adapters", type=int, default=4, help="distinct adapters, besides the base model")
    p.add_argument("--no-compile", action="store_true")
    add_model_size(p)
    args = p.parse_args()
    asyncio.run(run(args))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
