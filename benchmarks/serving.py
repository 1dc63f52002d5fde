"""Serving benchmark in the manner of SGLang's bench_serving: Poisson arrivals against a real lora-serve process.

    python -m benchmarks.serving [--rate 8] [--num-requests 64] [--max-batch-size 8] [--adapters 8 --zipf 1.1]
                                 [--door grpc|http|both [--rounds 3]] [--no-compile] [--model-size tiny]

Starts `lora-serve` (compiled) on the SmolLM2-135M-shaped checkpoint with N rank-16 adapters, sends requests
with seeded prompt/output lengths and adapters drawn uniform or Zipf, and reports TTFT, inter-token latency
(P50/P95/P99), output tokens/s and request throughput. Then, in the same run, it measures the engine's bare
decode step at the same batch size and prints P95 ITL against it, and replays the same requests through the
bare engine offline (Engine.generate) to show how much of the ITL tail is the engine's own prefill work.
With --target it only loads an already-running server.

--door picks the front door the load goes through: the gRPC SDK (default), or the OpenAI-compatible HTTP door
through the official `openai` client (streaming completions of the same token-id prompts). `both` serves both
from one process and alternates the same load through each door `--rounds` times, then prints each door's
latencies over all its rounds and the HTTP/gRPC ratio of P95 ITL (side by side, so machine noise hits both).
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import (LLAMA_1B, add_model_size, decode_step_time, percentile, random_checkpoint,
                               register_adapters, replay, sized_checkpoint, write_lora_adapters)
from benchmarks.load import StreamRecord, draw_adapter, grpc_stream, http_stream, open_loop, poisson_gaps
from benchmarks.server import ServerProcess, lora_serve
from service.client import AsyncLoraServeClient


def request_specs(args, adapters: list[str], rng: random.Random | None = None) -> list[tuple[list[int], str | None, int]]:
    """(prompt ids, adapter, max new tokens) per request, seeded."""
    rng = rng or random.Random(args.seed)
    return [([rng.randrange(3, 500) for _ in range(rng.randint(args.min_input, args.max_input))],
             draw_adapter(rng, adapters, args.zipf), rng.randint(args.min_output, args.max_output))
            for _ in range(args.num_requests)]


def offline_itl(engine, specs: list[tuple[list[int], str | None, int]]) -> list[float]:
    """The same requests through Engine.generate (no gRPC, no scheduler; all queued at once, so the batch
    stays full): every sequence's gaps between consecutive tokens (s)."""
    from lora_compile import SamplingParams

    last: dict[int, float] = {}
    gaps: list[float] = []

    def on_token(seq_id: int, _token: int) -> None:
        now = time.perf_counter()
        if seq_id in last:
            gaps.append(now - last[seq_id])
        last[seq_id] = now

    engine.generate([p for p, _, _ in specs], [SamplingParams(max_new_tokens=n, ignore_eos=True) for _, _, n in specs],
                    adapters=[a for _, a, _ in specs], on_token=on_token)
    return gaps


def arrivals(args, adapters: list[str]) -> tuple[list[tuple[list[int], str | None, int]], list[float]]:
    """The load's requests and, for each, the wait after sending it (Poisson; 0 at rate 0), from one seeded rng:
    run_load sends them, replay_ttft replays them into the bare engine."""
    rng = random.Random(args.seed)
    specs = request_specs(args, adapters, rng)  # then the same rng draws the gaps
    return specs, poisson_gaps(rng, args.rate, len(specs))


def replay_ttft(engine, specs: list[tuple[list[int], str | None, int]], times: list[float]) -> list[float]:
    """The same requests arriving at the same times through the bare engine (benchmarks.common.replay): each
    request's TTFT (s from its arrival)."""
    return replay(engine, specs, times).ttft


async def run_load(target: str, args, adapters: list[str], door: str = "grpc") -> tuple[list[StreamRecord], float]:
    """`target`: host:port of the gRPC door, or the HTTP door's base URL (http://host:port) for door "http"."""
    specs, gaps = arrivals(args, adapters)
    if door == "http":
        import openai
        # (HTTP/1.1: one stream per connection; the client's default pool holds 1000 connections)
        client = openai.AsyncOpenAI(base_url=f"{target}/v1", api_key="unused", max_retries=0, timeout=600)
        stream = http_stream
    else:
        client, stream = AsyncLoraServeClient(target), grpc_stream
    async with client:
        await stream(client, [5, 6, 7], None, 2)  # connection set-up outside the measurement
        return await open_loop(lambda spec: stream(client, *spec), specs, gaps)


def both_doors(grpc_target: str, http_target: str, args, names: list[str]) -> tuple[float, float]:
    """The same load through each door in turn, `args.rounds` times: (P95 ITL over gRPC, over HTTP)."""
    runs: dict[str, list[tuple[list[StreamRecord], float]]] = {"grpc": [], "http": []}
    for r in range(args.rounds):
        for door in ("grpc", "http") if r % 2 == 0 else ("http", "grpc"):  # alternate who goes first
            runs[door].append(asyncio.run(run_load(http_target if door == "http" else grpc_target,
                                                   args, names, door)))
            results = runs[door][-1][0]
            print(f"round {r + 1} {door}: P95 ITL {1000 * percentile([x for q in results for x in q.itl], 95):.1f} ms, "
                  f"{sum(q.error is not None for q in results)} failed", flush=True)
    p95 = {}
    for door, done in runs.items():
        print(f"--- {door} door, {len(done)} rounds")
        p95[door] = report([x for results, _ in done for x in results], sum(d for _, d in done))
    print(f"P95 ITL http / grpc = {p95['http'] / p95['grpc']:.3f}")
    return p95["grpc"], p95["http"]


def start_server(model: Path, adapter_dirs: list[Path], args, *flags: str) -> ServerProcess:
    """lora-serve sized for this load (the HTTP door on unless --door grpc); `flags`: more `lora-serve` flags."""
    adapters = [a for i, d in enumerate(adapter_dirs) for a in ("--adapter", f"a{i}={d}")]
    return lora_serve(model, "--max-batch-size", str(args.max_batch_size), "--max-seq-len", "512",
                      "--max-loras-per-batch", str(max(1, min(len(adapter_dirs), args.max_loras_per_batch))),
                      "--max-queue", str(args.num_requests),
                      "--max-num-batched-tokens", str(args.max_num_batched_tokens), *adapters,
                      *(["--no-compile"] if args.no_compile else []), *flags, http=args.door != "grpc")


def report(results: list[StreamRecord], duration: float) -> float:
    ok = [r for r in results if r.error is None]
    errors = [r.error for r in results if r.error]
    itl = [x for r in ok for x in r.itl]
    ttft = [r.ttft for r in ok]
    tokens = sum(r.output_tokens for r in ok)
    print(f"requests: {len(ok)} ok, {len(errors)} failed{' (' + errors[0] + ')' if errors else ''}; duration {duration:.1f}s")
    print(f"request throughput {len(ok) / duration:.2f} req/s, output {tokens / duration:.1f} tok/s")
    for name, values in (("TTFT", ttft), ("ITL", itl)):
        print(f"{name:5s} ms: mean {1000 * statistics.fmean(values):7.1f}  P50 {1000 * percentile(values, 50):7.1f}  "
              f"P95 {1000 * percentile(values, 95):7.1f}  P99 {1000 * percentile(values, 99):7.1f}")
    return percentile(itl, 95)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", help="an already-running server (skips start-up and the bare-engine comparison)")
    p.add_argument("--rate", type=float, default=8.0, help="requests/s (Poisson); 0 = all at once")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--zipf", type=float, default=0.0, help="Zipf exponent for adapter popularity; 0 = uniform")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=256, help="token budget per step (prefill chunk)")
    p.add_argument("--min-input", type=int, default=16)
    p.add_argument("--max-input", type=int, default=128)
    p.add_argument("--min-output", type=int, default=32)
    p.add_argument("--max-output", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--door", choices=["grpc", "http", "both"], default="grpc",
                   help="the front door the load goes through; both: alternate them, side by side")
    p.add_argument("--rounds", type=int, default=3, help="--door both: loads per door, alternated")
    p.add_argument("--http-target", help="with --target and --door http/both: the HTTP door's base URL")
    p.add_argument("--model", help="a checkpoint directory to serve (default: the SmolLM2-135M-shaped random one); "
                                   "'llama-1b': the Llama-3.2-1B-shaped bf16 one of benchmarks.cuda")
    add_model_size(p)
    p.add_argument("--no-compile", action="store_true", help="serve and measure the bare engine eagerly (fast start)")
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    names = [f"a{i}" for i in range(args.adapters)]
    if args.target:
        if args.door == "both":
            both_doors(args.target, args.http_target, args, names)
        else:
            target = args.http_target if args.door == "http" else args.target
            report(*asyncio.run(run_load(target, args, names, args.door)))
        return

    if args.model == "llama-1b":
        model = random_checkpoint("llama-1b-shaped-bf16", LLAMA_1B, torch.bfloat16)
    else:
        model = Path(args.model) if args.model else sized_checkpoint(args.model_size)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = write_lora_adapters(model, Path(tmp), names)
        server = start_server(model, list(adapters.values()), args)
        target, http_target = server.target, server.http_url
        try:
            print(f"lora-serve at {target} ({args.door} door): batch {args.max_batch_size}, {args.adapters} adapters "
                  f"({'zipf ' + str(args.zipf) if args.zipf else 'uniform'}), rate {args.rate or 'inf'} req/s")
            if args.door == "both":
                both_doors(target, http_target, args, names)
                return
            served = asyncio.run(run_load(http_target if args.door == "http" else target, args, names, args.door))
            p95 = report(*served)
        finally:
            server.stop()
        # The bare engine, same weights and adapters, same batch size, decoding with the same adapter mix.
        from lora_compile import Engine, EngineConfig
        engine = Engine(EngineConfig(model=str(model), max_batch_size=args.max_batch_size, max_seq_len=512,
                                     max_loras_per_batch=max(1, min(args.adapters, args.max_loras_per_batch)),
                                     max_num_batched_tokens=args.max_num_batched_tokens, compile=not args.no_compile))
        register_adapters(engine, adapters)
        engine.warmup()
        mix = names[: engine.config.max_loras_per_batch] or [None]
        step = statistics.median(decode_step_time(engine, args.max_batch_size, mix, 12)[0] for _ in range(3))
        print(f"bare engine decode step at batch {args.max_batch_size}: {1000 * step:.1f} ms; "
              f"P95 ITL / step = {p95 / step:.2f}x")
        # Prefill chunks make some steps longer than a decode step whatever serves them: the same requests
        # through the bare engine show what the engine alone gives, so the ratio is the service's share.
        offline = offline_itl(engine, request_specs(args, names))
        o50, o95 = percentile(offline, 50), percentile(offline, 95)
        print(f"bare engine, same requests offline: ITL P50 {1000 * o50:.1f} ms, P95 {1000 * o95:.1f} ms; "
              f"served P95 / offline P95 = {p95 / o95:.2f}x")
        # TTFT beside the engine's: the same requests at the same arrival times, replayed into the bare engine.
        specs, gaps = arrivals(args, names)
        replayed = replay_ttft(engine, specs, [0.0, *itertools.accumulate(gaps)][:-1])
        ttft = [r.ttft for r in served[0] if r.error is None]
        for q in (50, 95):
            print(f"TTFT P{q}: served {1000 * percentile(ttft, q):.1f} ms, bare engine (same arrivals) "
                  f"{1000 * percentile(replayed, q):.1f} ms; served / engine = "
                  f"{percentile(ttft, q) / percentile(replayed, q):.2f}x")


if __name__ == "__main__":
    main()
