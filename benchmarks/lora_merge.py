"""A lone adapter merged into the weights (the default on CPU float32) against the base model, in one engine, and
what merging costs: per adapter in all, and in the single step that takes the largest share of it.

    python -m benchmarks.lora_merge [--batch 8] [--rounds 15] [--adapters 4] [--no-compile] [--model-size tiny]

One engine instance only: two instances of the same engine step at speeds up to 5 % apart on a shared 2-core
VM (docs/benchmarks.md), so merged and base steps are compared within one.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.common import (add_model_size, decode_step_time, interleaved, register_adapters, sized_checkpoint,
                               write_lora_adapters)
from lora_compile import Engine, EngineConfig
from lora_compile.model import packed_gemm


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=15, help="interleaved repetitions; medians are reported")
    p.add_argument("--adapters", type=int, default=4, help="adapters merged in turn for the merge cost")
    p.add_argument("--no-compile", action="store_true", help="an eager engine (no torch.compile: starts in seconds)")
    add_model_size(p)
    args = p.parse_args()
    if packed_gemm.packed_rows(args.batch + 1) is None:
        p.error("--batch: a lone adapter is merged only in steps whose GEMMs run on packed weights, decode steps of "
                "5 to 64 sequences (lora_compile/model/packed_gemm.py)")
    model = sized_checkpoint(args.model_size)
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"a{i}" for i in range(args.adapters)]
        adapters = write_lora_adapters(model, Path(tmp), names)
        # float32: merging needs packed float32 weights (`auto` is bfloat16 on CPUs that compute it natively)
        engine = Engine(EngineConfig(model=str(model), dtype="float32", max_batch_size=args.batch, max_seq_len=256,
                                     max_num_batched_tokens=512, max_loras_per_batch=args.adapters, max_lora_rank=16,
                                     merge_lone_adapter="on", compile=not args.no_compile))
        register_adapters(engine, adapters)
        engine.warmup()
        merge_steps = engine._merger.steps_to_merge
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; batch {args.batch}, rank 16, all 7 modules")

        # Merge cost: each adapter alone in turn, a whole merge each; the step time of the base model for scale.
        base_step = statistics.median(decode_step_time(engine, args.batch, [None], args.steps)[0] for _ in range(3))
        for name in names:
            shares: list[float] = []
            step = engine.step

            def recording(*a, **kw):
                out = step(*a, **kw)
                shares.append(out.merge_s)
                return out

            engine.step = recording
            decode_step_time(engine, args.batch, [name], merge_steps)
            del engine.step
            print(f"merge of {name}: {1000 * sum(shares):.0f} ms in all, over {sum(s > 0 for s in shares)} steps; "
                  f"largest share {1000 * max(shares):.1f} ms in one step (base step {1000 * base_step:.1f} ms)")
        assert engine._merger.merges == len(names), "every adapter should have been merged"

        # Steady state: a0 merged (the last merge holds a{n-1}: merge a0 again, untimed), then base vs merged.
        decode_step_time(engine, args.batch, names[:1], merge_steps)
        t = interleaved({
            "base": lambda: decode_step_time(engine, args.batch, [None], args.steps)[0],
            "merged": lambda: decode_step_time(engine, args.batch, names[:1], args.steps)[0],
        }, args.rounds)
        assert engine._merger.merges == len(names) + 1, "the lone adapter should stay merged while measured"
        print(f"decode step, median of {args.rounds} interleaved rounds: base {1000 * t['base']:.1f} ms, "
              f"merged {1000 * t['merged']:.1f} ms; merged/base speed {t['base'] / t['merged']:.3f}x")


if __name__ == "__main__":
    main()
