"""Multi-LoRA decode throughput: base vs one adapter (the default engine, which merges a lone adapter into the
weights on CPU float32, and per-token LoRA with merging off) vs 8 distinct adapters vs peft's mixed-adapter
generate, and batch-init time as a share of the step.

    python -m benchmarks.lora [--batches 8 32] [--steps 16] [--no-peft] [--no-compile] [--model-size tiny]

Rank-16 adapters on all seven projections of a SmolLM2-135M-shaped random checkpoint, side by side in one run.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import (
    decode_step_time,
    fmt_row,
    interleaved,
    add_model_size,
    register_adapters,
    sized_checkpoint,
    write_lora_adapters,
)
from lora_compile import Engine, EngineConfig
from lora_compile.model import packed_gemm

N_ADAPTERS = 8
RANK = 16


def load_peft(model_dir: Path, adapter_dirs: list[Path]):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dirs[0], adapter_name="a0")
    for i, d in enumerate(adapter_dirs[1:], start=1):
        model.load_adapter(d, adapter_name=f"a{i}")
    return model.eval()


@torch.inference_mode()
def peft_step_time(model, n_adapters: int, batch: int, steps: int, prompt_len: int = 64,
                   adapters: list[str] | None = None) -> float:
    """Seconds per decode step of peft's generate, rows taking the adapters round-robin (`adapters`: these names,
    else a0..a{n_adapters-1})."""
    ids = torch.tensor([[(7 * i + j) % 500 + 3 for j in range(prompt_len)] for i in range(batch)])
    adapters = adapters or [f"a{i}" for i in range(n_adapters)]
    names = [adapters[i % len(adapters)] for i in range(batch)]

    def run(n: int) -> float:
        t0 = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0, adapter_names=names)
        return time.perf_counter() - t0

    run(4)
    return (run(4 + steps) - run(4)) / steps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=5, help="interleaved repetitions; medians are reported")
    p.add_argument("--no-peft", action="store_true")
    p.add_argument("--no-compile", action="store_true", help="eager engines (no torch.compile: start in seconds)")
    add_model_size(p)
    args = p.parse_args()
    model = sized_checkpoint(args.model_size)
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"a{i}" for i in range(N_ADAPTERS)]
        adapters = write_lora_adapters(model, Path(tmp), names, rank=RANK)
        limits = dict(model=str(model), dtype="float32", max_batch_size=max(args.batches), max_seq_len=256,
                      max_num_batched_tokens=512, max_loras_per_batch=N_ADAPTERS, max_lora_rank=RANK,
                      compile=not args.no_compile)
        engine = Engine(EngineConfig(**limits))  # the defaults: merges a lone adapter where it can
        unmerged = Engine(EngineConfig(**limits, merge_lone_adapter="off"))
        for e in (engine, unmerged):
            register_adapters(e, adapters)
            e.warmup()
        widths = (6, 9, 12, 13, 11, 11, 9, 14, 9, 10, 15)
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; rank {RANK}, all 7 modules, decode tok/s")
        print(fmt_row(("batch", "base", "one adapter", "one unmerged", f"{N_ADAPTERS} adapters", "peft mixed",
                       "one/base", "unmerged/base", "8/base", "ours/peft", "batch init"), widths))
        peft = None if args.no_peft else load_peft(model, list(adapters.values()))
        for b in args.batches:
            init: list[float] = []

            def mixed() -> float:
                step, batch_init = decode_step_time(engine, b, names, args.steps)
                init.append(batch_init / step)
                return step

            # The default engine merges a0 once, in this untimed run; later runs find it merged from their first
            # decode step.
            if engine._merger is not None:
                decode_step_time(engine, b, names[:1], engine._merger.steps_to_merge)
            measures = {
                "base": lambda: decode_step_time(engine, b, [None], args.steps)[0],
                "one": lambda: decode_step_time(engine, b, names[:1], args.steps)[0],
                "unmerged": lambda: decode_step_time(unmerged, b, names[:1], args.steps)[0],
                # the unmerged engine's own base steps: unmerged/base compares steps of one engine instance
                "unmerged base": lambda: decode_step_time(unmerged, b, [None], args.steps)[0],
                "mixed": mixed,
            }
            if peft is not None:
                measures["peft"] = lambda: peft_step_time(peft, N_ADAPTERS, b, args.steps)
            t = interleaved(measures, args.rounds)
            t_base, t_one, t_unmerged, t_mix = t["base"], t["one"], t["unmerged"], t["mixed"]
            t_peft = t.get("peft", float("nan"))
            t_init = sorted(init)[len(init) // 2] * t_mix
            print(fmt_row((b, f"{b / t_base:.1f}", f"{b / t_one:.1f}", f"{b / t_unmerged:.1f}", f"{b / t_mix:.1f}",
                           f"{b / t_peft:.1f}", f"{t_base / t_one:.2f}x", f"{t['unmerged base'] / t_unmerged:.2f}x",
                           f"{t_base / t_mix:.2f}x", f"{t_peft / t_mix:.2f}x", f"{100 * t_init / t_mix:.2f}% of step"),
                          widths), flush=True)
            if engine._merger is not None and packed_gemm.packed_rows(b + 1) is not None:
                assert engine._merger.merges == 1, "the lone adapter should stay merged"


if __name__ == "__main__":
    main()
