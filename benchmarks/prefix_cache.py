"""TTFT with the prefix cache on and off: tenants whose requests share a long system prompt.

    python -m benchmarks.prefix_cache [--num-requests 24] [--rounds 2] [--load 0.5 | --rate R] [--cold] [--no-compile]
                                      [--model-size tiny]

The SmolLM2-135M-shaped checkpoint (benchmarks.common) with 8 rank-16 adapters on all 7 projections; each adapter
has its own system prompt (--system-tokens, seeded random ids). A request is an adapter's system prompt plus a
user turn of 20-40 tokens, asking for 16 tokens (greedy, ignore_eos); adapters uniform, Poisson arrivals. Two
compiled engines, built in the engine thread, identical but for `enable_prefix_caching`, get the same arrivals
through the bare engine (benchmarks.common.replay), in turn within each round (the first alternating).

The rate: --rate, or --load times what the engine without the cache serves, one request at a time (1 / the
median TTFT of a lone request on it), so that the uncached engine is busy but not swamped on any machine.
Before each of its rounds the caching engine forgets its cache (each round replays the same requests, which must
not find their own copies) and serves every system prompt once (a server that has seen its tenants before, the
steady state); with --cold it does not, so each adapter's first request misses.
Prints each round's TTFT P50/P90 per engine and their ratio, then the percentiles over all rounds.

With --vllm-venv (or LORA_SERVE_VLLM_VENV), vLLM-CPU (float32, LoRA on, its prefix caching on: the default) serves
the same arrivals as a third system in each round, in a worker process of its own environment (benchmarks.peers;
requests added to its LLMEngine at their times, between steps), primed or reset like ours; the next system is
timed once vLLM's processes are idle.
"""
from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.common import (Replay, RequestSpec, add_model_size, percentile, register_adapters, replay,
                               sized_checkpoint, write_lora_adapters)
from benchmarks.peers import VllmWorker
from lora_compile import Engine, EngineConfig, SamplingParams
from lora_compile.config import ModelConfig, resolve_device, resolve_dtype
from lora_compile.kv_cache.sizing import bytes_per_block
from service.runner import engine_thread


def workload(args, names: list[str]) -> tuple[dict[str, list[int]], list[RequestSpec], list[float]]:
    """(system prompt per adapter, requests, arrival times at rate 1: scale by 1 / rate), from one seeded rng."""
    rng = random.Random(args.seed)
    system = {a: [rng.randrange(3, 500) for _ in range(args.system_tokens)] for a in names}
    specs = []
    for _ in range(args.num_requests):
        a = rng.choice(names)
        specs.append((system[a] + [rng.randrange(3, 500) for _ in range(rng.randint(args.min_user, args.max_user))],
                      a, args.new_tokens))
    gaps = [rng.expovariate(1.0) for _ in specs]
    return system, specs, [0.0, *itertools.accumulate(gaps)][:-1]


def build(model: Path, adapters: dict[str, Path], args, caching: bool) -> Engine:
    max_seq_len = args.system_tokens + args.max_user + args.new_tokens
    mc = ModelConfig.from_dir(model)
    per_block = bytes_per_block(mc, args.block_size, resolve_dtype(args.dtype, resolve_device("auto")))
    # Room for every system prompt cached plus --max-num-seqs sequences of max_seq_len: nothing is evicted that a
    # later request would hit, so "on" measures hits, not the pool's size.
    blocks = (len(adapters) + args.max_num_seqs) * -(-max_seq_len // args.block_size) + 1
    engine = Engine(EngineConfig(model=str(model), dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                                 max_seq_len=max_seq_len, max_loras_per_batch=len(adapters),
                                 max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                                 kv_cache_memory=blocks * per_block, enable_prefix_caching=caching,
                                 compile=not args.no_compile))
    register_adapters(engine, adapters)
    engine.warmup()
    return engine


def prime(engine: Engine, system: dict[str, list[int]], cold: bool) -> None:
    """The cache forgotten (the same requests come again each round: none may find its own earlier copy), then,
    unless `cold`, each system prompt served once."""
    engine.kv_cache.pool.reset_cache()  # (nothing is running between rounds)
    if not cold:
        names = list(system)
        engine.generate([system[a] for a in names], SamplingParams(max_new_tokens=1), names)


def vllm_replay(worker: VllmWorker, system: dict[str, list[int]], specs: list[RequestSpec], times: list[float],
                cold: bool) -> Replay:
    worker.reset_prefix_cache()
    if not cold:
        worker.run([system[a] for a in system], list(system), 1)
    reply = worker.replay([p for p, _, _ in specs], [a for _, a, _ in specs], specs[0][2], times)
    return Replay(reply["ttft"], 0.0, 0, cached_tokens=reply["cached_tokens"], prompt_tokens=reply["prompt_tokens"])


def summary(name: str, r: Replay) -> str:
    notes = [f"max running {max(s.running for s in r.steps)}"] if r.steps else []
    if r.cached_tokens:
        notes.append(f"{r.cached_tokens / r.prompt_tokens:.0%} of prompt tokens from the cache")
    return (f"{name:11s} TTFT P50 {1000 * percentile(r.ttft, 50):8.1f} ms  P90 {1000 * percentile(r.ttft, 90):8.1f} ms"
            f"  ({', '.join(notes)})")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num-requests", type=int, default=24, help="per engine and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rate", type=float, help="requests/s (Poisson); default: --load x the uncached engine's rate")
    p.add_argument("--load", type=float, default=0.5, help="arrivals per lone uncached request's TTFT")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--min-user", type=int, default=20)
    p.add_argument("--max-user", type=int, default=40)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--cold", action="store_true", help="forget the cache before each round instead of priming it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-venv", default=os.environ.get("LORA_SERVE_VLLM_VENV"))
    p.add_argument("--no-compile", action="store_true", help="eager engines (no torch.compile: start in seconds)")
    add_model_size(p)
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model = sized_checkpoint(args.model_size)
    names = [f"a{i}" for i in range(args.adapters)]
    system, specs, unit_times = workload(args, names)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = write_lora_adapters(model, Path(tmp), names)
        engines = {"caching on": engine_thread.call(build, model, adapters, args, True),
                   "caching off": engine_thread.call(build, model, adapters, args, False)}
        off = engines["caching off"]
        # Three lone requests on the uncached engine: the rate, and the long prompts' shapes run once.
        lone = [engine_thread.call(replay, off, [specs[i]], [0.0]).ttft[0] for i in range(3)]
        rate = args.rate or args.load / statistics.median(lone)
        times = [t / rate for t in unit_times]
        print(f"{len(specs)} requests per round, {args.adapters} adapters, system prompts of {args.system_tokens} "
              f"tokens, user turns {args.min_user}-{args.max_user}, {args.new_tokens} new tokens; lone uncached "
              f"TTFT {1000 * statistics.median(lone):.0f} ms -> rate {rate:.3f} req/s "
              f"({'cold' if args.cold else 'primed'} cache)", flush=True)
        systems = list(engines)
        venv = Path(args.vllm_venv) if args.vllm_venv else None
        worker = None
        if venv is not None and (venv / "bin" / "python").exists():
            worker = VllmWorker(venv, model, Path(tmp), "lora", torch.get_num_threads(),
                                args.system_tokens + args.max_user + args.new_tokens)
            systems.append("vllm on")
        else:
            print("vLLM-CPU: skipped (no --vllm-venv / LORA_SERVE_VLLM_VENV with bin/python)")
        runs: dict[str, list[Replay]] = {name: [] for name in systems}
        for rnd in range(args.rounds):
            for name in systems[rnd % len(systems):] + systems[:rnd % len(systems)]:  # who goes first rotates
                if name == "vllm on":
                    runs[name].append(vllm_replay(worker, system, specs, times, args.cold))
                else:
                    if name == "caching on":
                        engine_thread.call(prime, engines[name], system, args.cold)
                    runs[name].append(engine_thread.call(replay, engines[name], specs, times))
                print(f"round {rnd + 1} {summary(name, runs[name][-1])}", flush=True)
            on, off_ = runs["caching on"][-1], runs["caching off"][-1]
            print(f"round {rnd + 1} on / off: P50 {percentile(on.ttft, 50) / percentile(off_.ttft, 50):.3f}x  "
                  f"P90 {percentile(on.ttft, 90) / percentile(off_.ttft, 90):.3f}x", flush=True)
        if worker is not None:
            worker.close()
    pooled = {name: [t for r in rs for t in r.ttft] for name, rs in runs.items()}
    print(f"--- all {args.rounds} rounds ({args.rounds * len(specs)} requests per engine)")
    for name, ttft in pooled.items():
        print(f"{name:11s} TTFT P50 {1000 * percentile(ttft, 50):8.1f} ms  P90 {1000 * percentile(ttft, 90):8.1f} ms  "
              f"mean {1000 * statistics.fmean(ttft):8.1f} ms")
    on, off_ = pooled["caching on"], pooled["caching off"]
    print(f"TTFT on / off: P50 {percentile(on, 50) / percentile(off_, 50):.3f}x, "
          f"P90 {percentile(on, 90) / percentile(off_, 90):.3f}x")
    if "vllm on" in pooled:
        peer = pooled["vllm on"]
        print(f"TTFT ours on / vLLM on: P50 {percentile(on, 50) / percentile(peer, 50):.3f}x, "
              f"P90 {percentile(on, 90) / percentile(peer, 90):.3f}x")


if __name__ == "__main__":
    main()
