"""The engine on a GPU: decode throughput with and without CUDA graphs, base / one adapter / 8 distinct adapters,
against transformers + peft's `generate(adapter_names=...)` on the same weights; batch init as a share of a step.

A Llama-3.2-1B-like random model (benchmarks.common.LLAMA_1B) in bfloat16, rank-16 adapters on all seven
projections. Every configuration is measured in turn, round after round (benchmarks.common.interleaved), and the
ratios come from one run.

    python -m benchmarks.cuda [--batches 1 8 32 64] [--rounds 3] [--steps 64]
"""
from __future__ import annotations

import argparse
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
from lora_compile import Engine, EngineConfig

KINDS = {"base": lambda names: [None], "1 adapter": lambda names: names[:1], "8 adapters": lambda names: names[:8]}
PROMPT_LEN = 64


def build_engine(model: Path, adapters: dict[str, Path], max_batch: int, cuda_graphs: bool) -> Engine:
    engine = Engine(EngineConfig(model=str(model), device="cuda", dtype="bfloat16", max_batch_size=max_batch,
                                 max_seq_len=512, max_num_batched_tokens=2048, max_loras_per_batch=8,
                                 max_lora_rank=16, cuda_graphs=cuda_graphs))
    register_adapters(engine, adapters)
    t0 = time.perf_counter()
    engine.warmup()
    print(f"engine (CUDA graphs {'on' if cuda_graphs else 'off'}): warm-up {time.perf_counter() - t0:.1f}s")
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
    p.add_argument("--no-peft", action="store_true")
    args = p.parse_args()
    assert torch.cuda.is_available(), "benchmarks.cuda needs a CUDA GPU"
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    t0 = time.perf_counter()
    model = random_checkpoint("llama-1b-shaped-bf16", LLAMA_1B, torch.bfloat16)
    print(f"checkpoint {model} ready in {time.perf_counter() - t0:.1f}s")
    names = [f"a{i}" for i in range(8)]
    with tempfile.TemporaryDirectory() as tmp:
        adapters = write_lora_adapters(model, Path(tmp), names)
        max_batch = max(args.batches)
        engines = {graphs: build_engine(model, adapters, max_batch, graphs) for graphs in (True, False)}
        peft = None if args.no_peft else peft_model(model, adapters)
        inits: dict[str, list[float]] = {}

        def ours(graphs: bool, batch: int, kind: str):
            def measure() -> float:
                step, init = decode_step_time(engines[graphs], batch, KINDS[kind](names), args.steps, PROMPT_LEN)
                inits.setdefault(f"{graphs} {batch} {kind}", []).append(init / step)
                return step
            return measure

        measures = {}
        for batch in args.batches:
            for kind in KINDS:
                for graphs in (True, False):
                    measures[f"ours graphs={graphs} b{batch} {kind}"] = ours(graphs, batch, kind)
                if peft is not None and kind != "1 adapter":
                    measures[f"peft b{batch} {kind}"] = (
                        lambda b=batch, k=kind: peft_decode_seconds(peft, b, KINDS[k](names)))
        def printed(name, measure):
            def run() -> float:
                value = measure()
                print(f"  {name}: {1000 * value:.2f} ms/step", flush=True)  # a cut-off run still leaves its data
                return value
            return run

        steps = interleaved({name: printed(name, m) for name, m in measures.items()}, args.rounds)
    widths = (6, 11, 12, 12, 9, 10, 10, 12, 12)
    print("\ndecode tok/s (median of rounds), bf16; init = batch init / step with graphs")
    print(fmt_row(("batch", "kind", "graphs", "no graphs", "g / no-g", "peft", "ours / peft", "vs base", "init share"),
                  widths))
    for batch in args.batches:
        base = batch / steps[f"ours graphs=True b{batch} base"]
        for kind in KINDS:
            on, off = batch / steps[f"ours graphs=True b{batch} {kind}"], batch / steps[f"ours graphs=False b{batch} {kind}"]
            peft_key = f"peft b{batch} {kind}"
            peft_tps = batch / steps[peft_key] if peft_key in steps else None
            share = sorted(inits[f"True {batch} {kind}"])[len(inits[f"True {batch} {kind}"]) // 2]
            print(fmt_row((batch, kind, f"{on:.0f}", f"{off:.0f}", f"{on / off:.2f}x",
                           f"{peft_tps:.0f}" if peft_tps else "-", f"{on / peft_tps:.1f}x" if peft_tps else "-",
                           f"{on / base:.2f}x", f"{100 * share:.2f}%"), widths))
    for graphs, engine in engines.items():
        if engine._graphs is not None:
            print(f"graphs captured: {engine._graphs.num_graphs}, replays {engine._graphs.replays}")


if __name__ == "__main__":
    main()
