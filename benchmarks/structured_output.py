"""JSON-schema-constrained decode against free decode, side by side on one engine, and what a schema's compile costs
the first and the second time it is asked for.

    python -m benchmarks.structured_output [--batch 8] [--steps 32] [--rounds 5] [--no-compile] [--model-size tiny]

The SmolLM2-135M-shaped checkpoint (random weights), compiled, float32, 8 rank-16 adapters on all 7 projections
mixed across the batch, 64-token prompts. Every sequence of the constrained rounds is held to a JSON schema whose
one string field has minLength 300, so none ends inside the timed steps (a random model would otherwise close the
object early). Prints mean ms per decode step of each (medians of interleaved rounds) and their ratio.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import (add_model_size, decode_step_time, interleaved, register_adapters, sized_checkpoint,
                               write_lora_adapters)
from lora_compile import Engine, EngineConfig
from lora_compile.sample.structured_output import StructuredOutput

SCHEMA = {"type": "object", "required": ["text"], "additionalProperties": False,
          "properties": {"text": {"type": "string", "minLength": 300}}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-compile", action="store_true", help="an eager engine (no torch.compile: starts in seconds)")
    add_model_size(p)
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    model = sized_checkpoint(args.model_size)
    names = [f"a{i}" for i in range(8)]
    engine = Engine(EngineConfig(model=str(model), dtype="float32", max_num_seqs=args.batch, max_seq_len=512,
                                 max_num_batched_tokens=512, max_loras_per_batch=8, max_lora_rank=16,
                                 compile=not args.no_compile))
    with tempfile.TemporaryDirectory() as tmp:
        register_adapters(engine, write_lora_adapters(model, Path(tmp), names))
        engine.warmup()
        spec = StructuredOutput("json", json.dumps(SCHEMA))
        t0 = time.perf_counter()
        engine.grammars  # the tokenizer as the grammar engine sees it: once per engine
        t1 = time.perf_counter()
        engine.grammars.compile(spec)
        t2 = time.perf_counter()
        engine.grammars.compile(spec)
        t3 = time.perf_counter()
        print(f"grammar engine set-up {1000 * (t1 - t0):.1f} ms; schema compile: first request "
              f"{1000 * (t2 - t1):.2f} ms, second {1000 * (t3 - t2):.3f} ms (compiles {engine.grammars.compiles})")
        steps = interleaved({
            "free": lambda: decode_step_time(engine, args.batch, names, args.steps)[0],
            "json schema": lambda: decode_step_time(engine, args.batch, names, args.steps, structured_output=spec)[0],
        }, args.rounds)
    for name, seconds in steps.items():
        print(f"  {name:12s} {1000 * seconds:7.2f} ms/step  {args.batch / seconds:7.1f} tok/s")
    print(f"constrained / free tok/s: {steps['free'] / steps['json schema']:.3f}")


if __name__ == "__main__":
    main()
