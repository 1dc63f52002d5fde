"""How many kernels a compiled decoder layer launches per LoRA kernel (EngineConfig.lora_kernel), counted in the code
Inductor generates for the layer (its GEMMs and other library calls, and its own fused kernels), against the base
model's step. On CUDA a decode step's LoRA time follows its kernels' count (masked's three kernels a projection
took 0.68-0.93 ms of a 3.7-4.1 ms step on an H200, docs/benchmarks.md section 9); this counts them without timing
anything, on the CPU too, whose code generation fuses by the same scheduler (C++ kernels there, Triton ones on CUDA).

    python -m benchmarks.lora_kernel_count [--device cpu|cuda] [--kernels masked gathered stacked]

A 2-layer model of benchmarks.common.TINY's shape (the 1B model's widths on CUDA), 2 rank-16 adapters on all seven
projections; the layer graph of a step mixing the base model and both adapters, and of a base-model-only step.
"""
from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

import torch
from torch._inductor.utils import run_and_get_code

from benchmarks.common import LLAMA_1B, TINY, fmt_row, random_checkpoint, register_adapters, write_lora_adapters
from lora_compile import Engine, EngineConfig, SamplingParams

LIBRARY_CALL = re.compile(r"extern_kernels\.\w+\(|torch\.ops\.\w+\.\w+\.default\(")
FUSED_KERNEL = re.compile(r"^\s+(cpp_fused_\w+\(|triton_\w+\.run\()", re.M)


def layer_counts(codes: list[str]) -> tuple[int, int]:
    """(library calls, fused kernels) of the largest compiled graph among `codes` (the decoder layer's)."""
    counts = [(len(LIBRARY_CALL.findall(c)), len(FUSED_KERNEL.findall(c))) for c in codes]
    return max(counts, key=sum)


def count(model: Path, adapters: dict[str, Path], kernel: str, device: str, adapter_step: bool) -> tuple[int, int]:
    """The layer's counts for one kind of step, from an engine compiled afresh (its own Inductor cache)."""
    with tempfile.TemporaryDirectory() as cache:
        def run() -> None:
            engine = Engine(EngineConfig(model=str(model), device=device, dtype="bfloat16", compile=True,
                                         precompile=False, cuda_graphs=False, inductor_cache_dir=cache,
                                         max_num_seqs=4, max_seq_len=128, max_num_batched_tokens=128,
                                         max_loras_per_batch=2, max_lora_rank=16, lora_kernel=kernel))
            register_adapters(engine, adapters)
            names = [None, *adapters] if adapter_step else [None, None, None]
            engine.generate([[5, 6, 7, 8], [9, 10], [11, 12, 13]][:len(names)],
                            SamplingParams(max_new_tokens=3, ignore_eos=True), adapters=names)

        _, codes = run_and_get_code(run)
    return layer_counts(codes)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--kernels", nargs="+", default=["masked", "gathered", "stacked"],
                   choices=["indexed", "grouped", "masked", "gathered", "stacked"])
    args = p.parse_args()
    shape = (LLAMA_1B if args.device == "cuda" else TINY) | {"num_hidden_layers": 2}
    model = random_checkpoint(f"kernel-count-{args.device}", shape, torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = write_lora_adapters(model, Path(tmp), ["a0", "a1"])
        base = count(model, adapters, args.kernels[0], args.device, adapter_step=False)
        widths = (10, 15, 14, 22)
        print(f"kernels of one compiled decoder layer, {args.device}, bf16 ({torch.__version__})")
        print(fmt_row(("LoRA", "library calls", "fused kernels", "beyond the base step"), widths))
        print(fmt_row(("base", *base, "-"), widths))
        for kernel in args.kernels:
            calls, fused = count(model, adapters, kernel, args.device, adapter_step=True)
            print(fmt_row((kernel, calls, fused, f"+{calls - base[0]} calls, +{fused - base[1]} fused"), widths))


if __name__ == "__main__":
    main()
