"""How many sequences run at once, and how fast, in the KV memory of the old design's 8 slots x 1024 positions.

    python -m benchmarks.kv_capacity [--num-requests 100] [--rate 0] [--configs a b c] [--rounds 1] [--no-compile]
                                     [--model-size tiny]

The SmolLM2-135M-shaped checkpoint (benchmarks.common), 8 rank-16 adapters on all 7 projections (uniform), and a
seeded mix: prompts of 64-512 random tokens, 32-256 new tokens (greedy, ignore_eos), all arriving at t=0 (or
Poisson at --rate). Every engine gets kv_cache_memory = what --old-slots x --old-seq-len tokens take
(old_slots * old_seq_len / block_size blocks of lora_compile.kv_cache.sizing.bytes_per_block) and max_seq_len
--old-seq-len; the engines differ only in:

  a: max_num_seqs 8                       (the old design's concurrency at that memory)
  b: max_num_seqs 64, kv_growth "lazy"    (blocks as sequences grow; the newest is preempted when none is free)
  c: max_num_seqs 64, kv_growth "reserve" (prompt + max_new_tokens reserved at admission; never preempts)
  d: b with kv_cache_dtype "bfloat16"     (the same bytes hold twice the tokens; keys and values rounded)

Each is a compiled engine built in the engine thread; the same requests go through the bare engine
(benchmarks.common.replay), configurations in turn (rounds rotate the order). Per configuration: sequences
running (time-weighted mean at load, i.e. while requests waited, and over the run; max), output tokens/s over the
run, output tokens/s of the decode-only steps (the work more running sequences batch; every configuration
prefills the same prompts), preemptions, mean KV usage at load, and ratios to (a) within each round.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
from pathlib import Path
from types import SimpleNamespace

from benchmarks.common import (Replay, add_model_size, percentile, register_adapters, replay, sized_checkpoint,
                               write_lora_adapters)
from benchmarks.serving import arrivals
from lora_compile import Engine, EngineConfig
from lora_compile.config import ModelConfig, resolve_device, resolve_dtype
from lora_compile.kv_cache.sizing import bytes_per_block, format_bytes
from service import allocator
from service.runner import engine_thread

CONFIGS = {"a": dict(max_num_seqs=8, kv_growth="lazy"),
           "b": dict(max_num_seqs=64, kv_growth="lazy"),
           "c": dict(max_num_seqs=64, kv_growth="reserve"),
           "d": dict(max_num_seqs=64, kv_growth="lazy", kv_cache_dtype="bfloat16")}


def kv_budget(model: Path, args) -> int:
    """Bytes of the old design's KV cache: old_slots sequences of old_seq_len positions, in blocks."""
    per_block = bytes_per_block(ModelConfig.from_dir(model), args.block_size,
                                resolve_dtype(args.dtype, resolve_device("auto")))
    return args.old_slots * -(-args.old_seq_len // args.block_size) * per_block


def build(model: Path, adapters: dict[str, Path], args, config: dict) -> Engine:
    engine = Engine(EngineConfig(model=str(model), dtype=args.dtype, max_seq_len=args.old_seq_len,
                                 max_loras_per_batch=max(1, len(adapters)), block_size=args.block_size,
                                 max_num_batched_tokens=args.max_num_batched_tokens,
                                 kv_cache_memory=kv_budget(model, args), compile=not args.no_compile, **config))
    register_adapters(engine, adapters)
    engine.warmup()
    return engine


def kv_usage_at_load(r: Replay) -> float:
    steps = [s for s in r.steps if s.waiting]
    total = sum(s.seconds for s in steps)
    return sum(s.kv_usage * s.seconds for s in steps) / total if total else float("nan")


def line(name: str, r: Replay) -> str:
    return (f"{name}: {r.duration:6.1f} s, {r.output_tokens / r.duration:6.1f} out tok/s "
            f"({r.decode_throughput():6.1f} in decode-only steps); running: mean at load "
            f"{r.mean_running(at_load=True):5.1f}, over the run {r.mean_running():5.1f}, max "
            f"{max(s.running for s in r.steps):3d}; KV usage at load {kv_usage_at_load(r):.0%}; preemptions "
            f"{r.preemptions}; TTFT P50 {percentile(r.ttft, 50):.1f} s")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--rate", type=float, default=0.0, help="requests/s (Poisson); 0 = all at t=0")
    p.add_argument("--min-input", type=int, default=64)
    p.add_argument("--max-input", type=int, default=512)
    p.add_argument("--min-output", type=int, default=32)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--old-slots", type=int, default=8)
    p.add_argument("--old-seq-len", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=["a", "b", "c"])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-compile", action="store_true", help="eager engines (no torch.compile: start in seconds)")
    add_model_size(p)
    args = p.parse_args()
    allocator.reexec_with_tcmalloc()  # measure what lora-serve runs on (LORA_SERVE_ALLOCATOR=system: glibc's)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model = sized_checkpoint(args.model_size)
    names = [f"a{i}" for i in range(args.adapters)]
    specs, gaps = arrivals(SimpleNamespace(**vars(args), zipf=0.0), names)
    times = [0.0, *itertools.accumulate(gaps)][:-1]
    budget = kv_budget(model, args)
    print(f"{len(specs)} requests: prompts {args.min_input}-{args.max_input}, outputs {args.min_output}-"
          f"{args.max_output} tokens ({sum(len(s[0]) for s in specs)} prompt, {sum(s[2] for s in specs)} output in "
          f"all), {args.adapters} adapters, rate {args.rate or 'all at t=0'}; KV {format_bytes(budget)} = "
          f"{args.old_slots} x {args.old_seq_len} tokens", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = write_lora_adapters(model, Path(tmp), names)
        engines = {c: engine_thread.call(build, model, adapters, args, CONFIGS[c]) for c in args.configs}
        runs: dict[str, list[Replay]] = {c: [] for c in engines}
        for rnd in range(args.rounds):
            order = args.configs[rnd % len(args.configs):] + args.configs[:rnd % len(args.configs)]
            for c in order:
                runs[c].append(engine_thread.call(replay, engines[c], specs, times))
                print(f"round {rnd + 1} {c} {CONFIGS[c]}\n  {line(c, runs[c][-1])}", flush=True)
    print(f"--- medians over {args.rounds} round(s); ratios to (a) taken within each round")
    for c, rs in runs.items():
        tps = statistics.median(r.output_tokens / r.duration for r in rs)
        decode = statistics.median(r.decode_throughput() for r in rs)
        running = statistics.median(r.mean_running(at_load=True) for r in rs)
        text = (f"{c}: {tps:6.1f} out tok/s ({decode:6.1f} in decode-only steps), {running:5.1f} running at load, "
                f"{statistics.median(r.preemptions for r in rs)} preemptions")
        if "a" in runs and c != "a":  # (same requests, same output tokens: the throughput ratio is a time ratio)
            speed = statistics.median(a.duration / r.duration for a, r in zip(runs["a"], rs))
            more = statistics.median(r.mean_running(True) / a.mean_running(True) for a, r in zip(runs["a"], rs))
            dec = statistics.median(r.decode_throughput() / a.decode_throughput() for a, r in zip(runs["a"], rs))
            text += f"; throughput x{speed:.2f} (a), decode-only steps x{dec:.2f} (a), running at load x{more:.2f} (a)"
        print(text)


if __name__ == "__main__":
    main()
