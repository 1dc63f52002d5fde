"""Decode throughput of the engine, compiled vs eager vs transformers, and cold/warm start time.

    python -m benchmarks.engine [--batches 1 8 32] [--steps 16] [--model-size tiny] [--no-compile]

Everything is measured side by side in this one run, on a SmolLM2-135M-shaped random checkpoint.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.common import add_model_size, decode_step_time, fmt_row, interleaved, sized_checkpoint
from lora_compile import Engine, EngineConfig

# float32: compared with transformers in float32 (`auto` would be bfloat16 on CPUs with native bf16).
LIMITS = dict(dtype="float32", max_batch_size=32, max_seq_len=256, max_num_batched_tokens=512, max_loras_per_batch=8, max_lora_rank=16)


def start_only(model: str, cache_dir: str, precompile: bool, compile: bool = True) -> None:
    engine = Engine(EngineConfig(model=model, inductor_cache_dir=cache_dir, precompile=precompile, compile=compile,
                                 **LIMITS))
    engine.warmup()
    print("READY", flush=True)


def time_start(model: str, cache_dir: str, precompile: bool = True, compile: bool = True) -> float:
    """Seconds from process launch to a warmed-up engine (imports, load, compile or cache hit)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "benchmarks.engine", "--start-only", "--model", model, "--cache", cache_dir,
                    *([] if precompile else ["--no-precompile"]), *([] if compile else ["--no-compile"])],
                   check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


@torch.inference_mode()
def transformers_step_time(model, batch: int, steps: int, prompt_len: int = 64) -> float:
    ids = torch.tensor([[(7 * i + j) % 500 + 3 for j in range(prompt_len)] for i in range(batch)])

    def run(n: int) -> float:
        t0 = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0

    run(4)
    short, long = 4, 4 + steps
    return (run(long) - run(short)) / steps  # prefill and set-up cancel out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=5, help="interleaved repetitions; medians are reported")
    p.add_argument("--start-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    p.add_argument("--no-precompile", action="store_true", help=argparse.SUPPRESS)
    add_model_size(p)
    p.add_argument("--no-compile", action="store_true",
                   help="every engine eager, the compiled columns too (a check that the benchmark runs)")
    args = p.parse_args()
    compile = not args.no_compile
    if args.start_only:
        return start_only(args.model, args.cache, not args.no_precompile, compile)

    model = str(sized_checkpoint(args.model_size))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, checkpoint {model}")
    with tempfile.TemporaryDirectory() as cache:
        cold = time_start(model, cache, compile=compile)
        warm = time_start(model, cache, compile=compile)
        traced = time_start(model, cache, False, compile)  # the same cache; Dynamo traces the stack again
    print(f"start to ready (load + warm-up), fresh process: cold cache {cold:.1f}s, warm cache {warm:.1f}s "
          f"(the stack traced at start, --no-precompile: {traced:.1f}s)")

    compiled = Engine(EngineConfig(model=model, compile=compile, **LIMITS))
    compiled.warmup()
    eager = Engine(EngineConfig(model=model, compile=False, **LIMITS))
    # The same compiled engine on plain (MKL) weights: what the oneDNN-packed weights bring.
    plain = Engine(EngineConfig(model=model, prepack_weights=False, compile=compile, **LIMITS))
    plain.warmup()
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    widths = (6, 14, 14, 14, 18, 10, 10, 12)
    print(fmt_row(("batch", "compiled tok/s", "eager tok/s", "hf tok/s", "compiled unpacked", "c/eager", "c/hf",
                   "c/unpacked"), widths))
    for b in args.batches:
        t = interleaved({
            "compiled": lambda: decode_step_time(compiled, b, [None], args.steps)[0],
            "eager": lambda: decode_step_time(eager, b, [None], args.steps)[0],
            "hf": lambda: transformers_step_time(hf, b, args.steps),
            "plain": lambda: decode_step_time(plain, b, [None], args.steps)[0],
        }, args.rounds)
        tc, te, th, tp = t["compiled"], t["eager"], t["hf"], t["plain"]
        print(fmt_row((b, f"{b / tc:.1f}", f"{b / te:.1f}", f"{b / th:.1f}", f"{b / tp:.1f}", f"{te / tc:.2f}x",
                       f"{th / tc:.2f}x", f"{tp / tc:.2f}x"), widths), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
