"""Decode step time of this tree beside another checkout (e.g. the slot KV cache the paged one replaced), each
measured in its own process, the two alternating pair by pair, so drift on a shared machine hits both alike.

    python -m benchmarks.paged_decode --baseline /path/to/other/checkout [--batches 8 32] [--pairs 3] [--device cuda]
        [--dtype bfloat16] [--no-compile] [--model-size tiny]

On the CPU the SmolLM2-135M-shaped checkpoint, compiled, float32 (or --dtype); on CUDA 4 layers of the
Llama-3.2-1B shape, bfloat16, CUDA graphs, the indexed LoRA kernel and no builds ahead where the tree has those
knobs (the slot tree had neither). Per batch size: the base model, and 8 rank-16 adapters on all 7 projections
mixed across the batch. Prompts of --prompt-len tokens, then --steps decode steps timed
(benchmarks.common.decode_step_time, which both trees have). Prints each pair's step times and the ratio
this tree / baseline (median over pairs).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from service import allocator

HERE = Path(__file__).resolve().parent.parent

# Runs inside each tree, with only what both trees have.
MEASURE = """
import dataclasses, json, sys, tempfile
from pathlib import Path
import torch
from benchmarks.common import (LLAMA_1B, decode_step_time, random_checkpoint, register_adapters, smollm2_checkpoint,
                               write_lora_adapters)
from lora_compile import Engine, EngineConfig
from service.runner import engine_thread
batches, steps, prompt_len, device, dtype = (json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                                             sys.argv[5])
compile, cpu_shape = sys.argv[6] == "1", json.loads(sys.argv[7])  # (a shape of its own: --model-size tiny)
def run():
    names = [f"a{i}" for i in range(8)]
    kw = dict(max_batch_size=max(batches), max_seq_len=prompt_len + steps + 64, max_num_batched_tokens=512,
              max_loras_per_batch=8, max_lora_rank=16, compile=compile)
    if device == "cuda":
        model = random_checkpoint("llama-1b-width-4-layers-bf16", LLAMA_1B | {"num_hidden_layers": 4}, torch.bfloat16)
        knobs = {f.name for f in dataclasses.fields(EngineConfig)}
        kw.update(device="cuda", dtype="bfloat16", max_num_batched_tokens=max(512, max(batches) * prompt_len))
        kw.update({k: v for k, v in (("lora_kernel", "indexed"), ("overlap_batch_init", False)) if k in knobs})
    else:
        model = random_checkpoint("tiny-smollm2-family", cpu_shape) if cpu_shape else smollm2_checkpoint()
        kw.update(dtype=dtype)
    engine = Engine(EngineConfig(model=str(model), **kw))
    register_adapters(engine, write_lora_adapters(model, Path(tempfile.mkdtemp()), names))
    engine.warmup()
    out = {}
    for b in batches:
        for kind, adapters in (("base", [None]), ("8 adapters", names)):
            decode_step_time(engine, b, adapters, 4, prompt_len)  # settle
            out[f"{kind} batch {b}"] = decode_step_time(engine, b, adapters, steps, prompt_len)[0]
    return out
print("RESULT " + json.dumps(engine_thread.call(run)), flush=True)
"""


def measure(tree: Path, batches: list[int], steps: int, prompt_len: int, device: str, dtype: str,
            compile: bool = True, cpu_shape: dict | None = None) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(tree), os.environ.get("PYTHONPATH")))))
    argv = [json.dumps(batches), str(steps), str(prompt_len), device, dtype, "1" if compile else "0",
            json.dumps(cpu_shape)]
    proc = subprocess.run([sys.executable, "-c", MEASURE, *argv],
                          cwd=tree, env=env, capture_output=True, text=True, check=True)
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def tiny_shape() -> dict:
    from benchmarks.common import TINY  # (torch: this process imports it only here)

    return TINY


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", type=Path, required=True, help="the other checkout (its own lora_compile)")
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the CPU model's (CUDA: bfloat16)")
    p.add_argument("--no-compile", action="store_true", help="eager engines (no torch.compile: start in seconds)")
    p.add_argument("--model-size", choices=["smollm2-135m", "tiny"], default="smollm2-135m",
                   help="tiny: 2 layers of SmolLM2's family on the CPU, to check that the benchmark runs (its "
                        "figures mean nothing)")
    args = p.parse_args()
    allocator.reexec_with_tcmalloc()  # measure what lora-serve runs on (LORA_SERVE_ALLOCATOR=system: glibc's)
    ratios: dict[str, list[float]] = {}
    for i in range(args.pairs):
        order = [("this", HERE), ("baseline", args.baseline.resolve())]
        if i % 2:
            order.reverse()
        shape = tiny_shape() if args.model_size == "tiny" else None
        got = {name: measure(tree, args.batches, args.steps, args.prompt_len, args.device, args.dtype,
                             not args.no_compile, shape) for name, tree in order}
        for key, t in got["this"].items():
            b = got["baseline"][key]
            ratios.setdefault(key, []).append(t / b)
            print(f"pair {i + 1}  {key:<22} this {1000 * t:7.2f} ms  baseline {1000 * b:7.2f} ms  ratio {t / b:.3f}",
                  flush=True)
    print("median ratio this / baseline (below 1: this tree is faster)")
    for key, r in ratios.items():
        print(f"  {key:<22} {statistics.median(r):.3f}  ({', '.join(f'{x:.3f}' for x in r)})")


if __name__ == "__main__":
    main()
