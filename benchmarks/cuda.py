"""The engine on a GPU: decode throughput per LoRA kernel (EngineConfig.lora_kernel: masked, grouped, indexed,
gathered, stacked) with CUDA graphs, base / one adapter / 8 distinct adapters, against transformers + peft's
`generate(adapter_names=...)` on the same weights; the same steps without graphs (--no-graphs); quantized base
weights (--quantization int8 int4: the first kernel's rows again, against the full-width base); batch init as a
share of a step.

A Llama-3.2-1B-like random model (benchmarks.common.LLAMA_1B) in bfloat16, rank-16 adapters on all seven
projections. Every configuration is measured in turn, round after round (benchmarks.common.interleaved), and the
ratios come from one run.

    python -m benchmarks.cuda [--batches 1 8 32 64] [--rounds 3] [--steps 64] [--kernels masked grouped indexed]
        [--no-graphs] [--quantization int8 int4] [--peft-batches 8 32] [--prefill 8 64 --prefill 8 256] [--trace DIR]

--trace DIR: then the GPU's kernel records of decode steps (batches --trace-batches) and of each prefill, per kernel
(benchmarks.cuda_profile), printed by kernel family and written to DIR.
"""
from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import (
    LLAMA_1B,
    decode_step_time,
    fmt_row,
    interleaved,
    random_checkpoint,
    register_adapters,
    write_lora_adapters,
)
from lora_compile import Engine, EngineConfig, SamplingParams, Sequence

_PREFILL_CALLS = itertools.count()
KINDS = {"base": lambda names: [None], "1 adapter": lambda names: names[:1], "8 adapters": lambda names: names[:8]}
PROMPT_LEN = 64


def build_engine(model: Path, adapters: dict[str, Path], max_batch: int, cuda_graphs: bool, kernel: str,
                 attention: str = "auto", quantization: str = "none") -> Engine:
    engine = Engine(EngineConfig(model=str(model), device="cuda", dtype="bfloat16", max_num_seqs=max_batch,
                                 max_seq_len=512, max_num_batched_tokens=2048, max_loras_per_batch=8,
                                 max_lora_rank=16, cuda_graphs=cuda_graphs, lora_kernel=kernel,
                                 attention_backend=attention, quantization=quantization))
    register_adapters(engine, adapters)
    t0 = time.perf_counter()
    engine.warmup()
    print(f"engine ({engine.lora_kernel} LoRA, {engine.attention_backend} attention, CUDA graphs "
          f"{'on' if cuda_graphs else 'off'}, weights {quantization}): warm-up {time.perf_counter() - t0:.1f}s",
          flush=True)
    return engine


def peft_model(model: Path, adapters: dict[str, Path]):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to("cuda")
    names = list(adapters)
    peft = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        peft.load_adapter(adapters[name], adapter_name=name)
    return peft.eval()


def peft_decode_seconds(peft, batch: int, names: list[str | None]) -> float:
    """Seconds per decode step of `generate(adapter_names=...)`: the difference of two lengths, so that prefill
    and set-up cancel out."""
    ids = torch.tensor([[(7 * b + j) % 500 + 3 for j in range(PROMPT_LEN)] for b in range(batch)], device="cuda")
    adapter_names = [names[b % len(names)] or "__base__" for b in range(batch)]

    def run(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            peft.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, adapter_names=adapter_names, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    run(4)
    short, long = 4, 20
    return (run(long) - run(short)) / (long - short)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--kernels", nargs="+", default=["masked", "grouped", "indexed"],
                   choices=["grouped", "masked", "indexed", "gathered", "stacked"])
    p.add_argument("--quantization", nargs="*", default=[], choices=["int8", "int4"],
                   help="also the first kernel's engine with its base weights in these forms (quantized at load)")
    p.add_argument("--prefill", type=int, nargs=2, action="append", metavar=("SEQS", "TOKENS"),
                   help="also one prefill step of SEQS prompts of TOKENS tokens, base and 8 adapters; repeatable "
                        "(default 8 256)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "sdpa", "inductor"])
    p.add_argument("--trace", type=Path, default=None, help="write the kernel records of traced steps here")
    p.add_argument("--trace-batches", type=int, nargs="+", default=[8, 64])
    p.add_argument("--no-graphs", action="store_true", help="also the first kernel's steps without CUDA graphs")
    p.add_argument("--peft-batches", type=int, nargs="*", default=None, help="batches peft runs at (default: all)")
    p.add_argument("--no-peft", action="store_true")
    p.add_argument("--profile-init", action="store_true",
                   help="then profile the host side of 20 decode steps (largest batch, 8 adapters, first kernel)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks.cuda: skipped (it needs a CUDA GPU; torch sees none)")
        return
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    t0 = time.perf_counter()
    model = random_checkpoint("llama-1b-shaped-bf16", LLAMA_1B, torch.bfloat16)
    print(f"checkpoint {model} ready in {time.perf_counter() - t0:.1f}s", flush=True)
    names = [f"a{i}" for i in range(8)]
    peft_batches = args.batches if args.peft_batches is None else args.peft_batches
    with tempfile.TemporaryDirectory() as tmp:
        adapters = write_lora_adapters(model, Path(tmp), names)
        max_batch = max(args.batches)
        # (kernel, CUDA graphs, quantization)
        configs = ([(k, True, "none") for k in args.kernels] + ([(args.kernels[0], False, "none")] if args.no_graphs
                                                                else [])
                   + [(args.kernels[0], True, q) for q in args.quantization])
        engines = {c: build_engine(model, adapters, max_batch, c[1], c[0], args.attention_backend, c[2])
                   for c in configs}
        peft = None if args.no_peft or not peft_batches else peft_model(model, adapters)
        inits: dict[str, list[float]] = {}

        def ours(config, batch: int, kind: str):
            def measure() -> float:
                step, init = decode_step_time(engines[config], batch, KINDS[kind](names), args.steps, PROMPT_LEN)
                inits.setdefault(f"{config} {batch} {kind}", []).append(init / step)
                return step
            return measure

        measures = {}
        prefills = args.prefill or [(8, 256)]
        for config in configs:
            for kind in ("base", "8 adapters"):
                if (kind == "base" and config[0] != args.kernels[0]) or config[2] != "none":  # (prefill: full width)
                    continue
                for seqs, length in prefills:
                    # first calls of these sizes (cuBLAS heuristics, allocator growth) outside the measurement
                    prefill_step_time(engines[config], seqs, KINDS[kind](names), length)
                    measures[f"prefill {seqs}x{length} {config} {kind}"] = (
                        lambda c=config, k=kind, s=seqs, n=length: prefill_step_time(engines[c], s, KINDS[k](names), n))
        for batch in args.batches:
            for kind in KINDS:
                for config in configs:
                    if kind == "base" and config[0] != args.kernels[0]:
                        continue  # no LoRA work: the same step whatever the kernel
                    if config[2] != "none" and kind == "1 adapter":
                        continue
                    measures[f"ours {config} b{batch} {kind}"] = ours(config, batch, kind)
                if peft is not None and kind != "1 adapter" and batch in peft_batches:
                    measures[f"peft b{batch} {kind}"] = (
                        lambda b=batch, k=kind: peft_decode_seconds(peft, b, KINDS[k](names)))

        def printed(name, measure):
            def run() -> float:
                value = measure()
                print(f"  {name}: {1000 * value:.2f} ms/step", flush=True)  # a cut-off run still leaves its data
                return value
            return run

        steps = interleaved({name: printed(name, m) for name, m in measures.items()}, args.rounds)
    widths = (6, 11, 9, 7, 10, 9, 10, 10, 12, 9, 11)
    print("\ndecode tok/s (median of rounds), bf16 activations, CUDA graphs; vs base = against the full-width base; "
          "init = batch init / step")
    print(fmt_row(("batch", "kind", "kernel", "weights", "tok/s", "no graphs", "peft", "ours/peft", "vs base", "init",
                   "init ms"), widths))
    first = (args.kernels[0], True, "none")
    for batch in args.batches:
        base = batch / steps[f"ours {first} b{batch} base"]
        for kind in KINDS:
            for config in configs:
                key = f"ours {config} b{batch} {kind}"
                if key not in steps or not config[1]:
                    continue
                tps = batch / steps[key]
                off_key = f"ours {(config[0], False, config[2])} b{batch} {kind}"
                off = f"{batch / steps[off_key]:.0f}" if off_key in steps else "-"
                peft_key = f"peft b{batch} {kind}"
                peft_tps = batch / steps[peft_key] if peft_key in steps else None
                shares = sorted(inits[f"{config} {batch} {kind}"])
                share = shares[len(shares) // 2]
                print(fmt_row((batch, kind, config[0] if kind != "base" else "-", config[2], f"{tps:.0f}", off,
                               f"{peft_tps:.0f}" if peft_tps else "-", f"{tps / peft_tps:.1f}x" if peft_tps else "-",
                               f"{tps / base:.2f}x", f"{100 * share:.2f}%",
                               f"{1000 * share * steps[key]:.3f}"), widths))
    print("\nprefill step, prompts x tokens (median of rounds):")
    for seqs, length in prefills:
        base_prefill = steps[f"prefill {seqs}x{length} {first} base"]
        for name, value in steps.items():
            if name.startswith(f"prefill {seqs}x{length} "):
                print(f"  {name[8:]}: {1000 * value:.2f} ms ({value / base_prefill:.2f}x base)")
    for config, engine in engines.items():
        if engine._graphs is not None:
            print(f"{config}: graphs captured {engine._graphs.num_graphs}, replays {engine._graphs.replays}")
    if args.profile_init:
        profile_host(engines[first], max_batch, names)
    if args.trace is not None:
        from benchmarks.cuda_profile import trace_engine

        for config, engine in engines.items():
            if config[1]:
                trace_engine(engine, "-".join(c for c in (config[0], config[2]) if c != "none"), args.trace_batches,
                             names, prefills, args.trace)


def prefill_step_time(engine: Engine, seqs: int, adapters: list[str | None], prompt_len: int) -> float:
    """Seconds of one step that prefills `seqs` prompts of `prompt_len` tokens at once (prompts never seen before:
    no prefix cache hit), read back."""
    call = next(_PREFILL_CALLS)
    run = [Sequence(10_000 + i, [(11 * i + 5 * j + 97 * call) % 700 + 3 for j in range(prompt_len)],
                    SamplingParams(max_new_tokens=2, ignore_eos=True), adapters[i % len(adapters)]) for i in range(seqs)]
    for s in run:
        assert engine.try_admit(s)
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = engine.step(run)
        torch.cuda.synchronize()
        assert out.num_tokens == seqs * prompt_len, "the prompts did not fit one step"
        return time.perf_counter() - t0
    finally:
        for s in run:
            engine.release(s)


def profile_host(engine: Engine, batch: int, names: list[str]) -> None:
    """Where a decode step's host time goes (cProfile, cumulative), to see what batch init spends."""
    import cProfile
    import pstats

    decode_step_time(engine, batch, names, 4, PROMPT_LEN)  # warm
    profiler = cProfile.Profile()
    profiler.enable()
    decode_step_time(engine, batch, names, 20, PROMPT_LEN)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(r"lora_compile", 30)


if __name__ == "__main__":
    main()
