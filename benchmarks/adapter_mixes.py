"""Weighted adapter mixes: decode with 8 distinct mixes of 2 adapters against 8 distinct single adapters and the
base model, side by side in one run, and what putting a mix into a device slot costs against one adapter.

    python -m benchmarks.adapter_mixes [--batches 8 32] [--steps 12] [--rounds 5] [--no-peft] [--no-compile]
                                       [--model-size tiny]

16 rank-8 adapters on all seven projections of a SmolLM2-135M-shaped random checkpoint; --max-lora-rank 16, so a
mix of two is rank 16 and fits a slot. Singles: a0..a7; mixes: a(2i)·0.6 + a(2i+1)·0.4 for i < 8 (16 members,
8 slots). Sequences take the adapters round-robin. "peft mixed" is PEFT's generate with the same 8 mixes made by
add_weighted_adapter(..., "cat") and adapter_names per row (its mixed-batch inference), float32 like ours.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import cpu_report
from benchmarks.common import (
    add_model_size,
    decode_step_time,
    fmt_row,
    interleaved,
    register_adapters,
    sized_checkpoint,
    write_lora_adapters,
)
from benchmarks.lora import load_peft, peft_step_time
from lora_compile import Engine, EngineConfig
from lora_compile.lora.mixes import AdapterMix

N_SLOTS = 8
MEMBER_RANK = 8
WEIGHTS = (0.6, 0.4)


def mixes(names: list[str]) -> list[str]:
    return [AdapterMix(((names[2 * i], WEIGHTS[0]), (names[2 * i + 1], WEIGHTS[1]))).name for i in range(N_SLOTS)]


def slot_load_ms(engine: Engine, names: list[str], rounds: int) -> float:
    """Median milliseconds for acquire() to put `names[i]` into a slot it was not in (compose + copy for a mix)."""
    times = []
    for _ in range(rounds):
        for name in names:
            for slot_name in engine.adapters.device_names():
                engine.adapters._slots.forget(slot_name)  # (not pinned: an empty slot for the next acquire)
            t0 = time.perf_counter()
            slot, loaded = engine.adapters.acquire(name)
            times.append((time.perf_counter() - t0) * 1e3)
            assert loaded
            engine.adapters.release(slot)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=5, help="interleaved repetitions; medians are reported")
    p.add_argument("--no-peft", action="store_true")
    p.add_argument("--no-compile", action="store_true", help="an eager engine (no torch.compile: starts in seconds)")
    add_model_size(p)
    args = p.parse_args()
    print(cpu_report.describe(2))
    model = sized_checkpoint(args.model_size)
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"a{i}" for i in range(2 * N_SLOTS)]
        adapters = write_lora_adapters(model, Path(tmp), names, rank=MEMBER_RANK)
        engine = Engine(EngineConfig(model=str(model), dtype="float32", max_batch_size=max(args.batches),
                                     max_seq_len=256, max_num_batched_tokens=512, max_loras_per_batch=N_SLOTS,
                                     max_lora_rank=2 * MEMBER_RANK, merge_lone_adapter="off",
                                     compile=not args.no_compile))
        register_adapters(engine, adapters)
        engine.warmup()
        singles, mixed = names[:N_SLOTS], mixes(names)
        peft = None
        if not args.no_peft:
            peft = load_peft(model, list(adapters.values()))
            for i, name in enumerate(mixed):  # (PEFT names may not hold '.': m0..m7)
                members = AdapterMix.parse(name).members
                peft.add_weighted_adapter([n for n, _ in members], [w for _, w in members], f"m{i}",
                                          combination_type="cat")
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; members rank {MEMBER_RANK}, all 7 "
              f"modules, --max-lora-rank {2 * MEMBER_RANK}; decode tok/s")
        widths = (6, 9, 12, 10, 11, 13, 12, 11)
        print(fmt_row(("batch", "base", "8 singles", "8 mixes", "peft mixes", "mixes/singles", "mixes/base",
                       "ours/peft"), widths))
        for b in args.batches:
            measures = {
                "base": lambda: decode_step_time(engine, b, [None], args.steps)[0],
                "singles": lambda: decode_step_time(engine, b, singles, args.steps)[0],
                "mixes": lambda: decode_step_time(engine, b, mixed, args.steps)[0],
            }
            if peft is not None:
                measures["peft"] = lambda: peft_step_time(peft, N_SLOTS, b, args.steps,
                                                          adapters=[f"m{i}" for i in range(N_SLOTS)])
            t = interleaved(measures, args.rounds)
            t_peft = t.get("peft", float("nan"))
            print(fmt_row((b, f"{b / t['base']:.1f}", f"{b / t['singles']:.1f}", f"{b / t['mixes']:.1f}",
                           f"{b / t_peft:.1f}", f"{t['singles'] / t['mixes']:.2f}x", f"{t['base'] / t['mixes']:.2f}x",
                           f"{t_peft / t['mixes']:.2f}x"), widths), flush=True)
        single_ms, mix_ms = slot_load_ms(engine, singles, args.rounds), slot_load_ms(engine, mixed, args.rounds)
        print(f"into a device slot (median): one adapter {single_ms:.2f} ms, a mix of 2 {mix_ms:.2f} ms "
              f"(composed from host copies, then copied)")


if __name__ == "__main__":
    main()
