"""Where a CPU decode step's time goes, by kernel family: the profile that names what a peer comparison is made of.

    python -m benchmarks.step_profile [--batches 8 32] [--steps 24] [--prompt-len 48] [--threads 2] [--no-compile]
                                      [--model-size tiny]

The SmolLM2-135M-shaped checkpoint (benchmarks.common), compiled, float32, the base model and 8 rank-16 adapters
on all 7 projections mixed across the batch. torch.profiler over --steps decode steps; per step, milliseconds and
shares of: the oneDNN GEMMs (packed linear layers and the logits), the compiled graph's own generated kernels
(attention, LoRA, norms, rotary, activations: the graph's self time), the sampler (argmax and friends), and the
rest (Python, batch init). The difference between the 8-adapter and the base rows is what LoRA costs.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import cpu_report
from benchmarks.common import add_model_size, decode_step_time, register_adapters, sized_checkpoint, write_lora_adapters
from lora_compile import Engine, EngineConfig
from service import allocator
from service.runner import engine_thread

GEMM = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm")
GRAPH = "## Call CompiledFxGraph"
SAMPLER = ("aten::argmax", "aten::amax", "aten::amin", "aten::topk", "aten::sort", "aten::softmax")


def shares(prof, steps: int) -> dict[str, float]:
    """ms per step by family, from the profile's self CPU times of the engine thread's ops."""
    out = {"oneDNN GEMMs": 0.0, "compiled kernels": 0.0, "sampler": 0.0, "other ops": 0.0}
    for event in prof.key_averages():
        ms = event.self_cpu_time_total / 1000 / steps
        if event.key in GEMM:
            out["oneDNN GEMMs"] += ms
        elif event.key.startswith(GRAPH):
            out["compiled kernels"] += ms
        elif event.key in SAMPLER:
            out["sampler"] += ms
        else:
            out["other ops"] += ms
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-compile", action="store_true", help="an eager engine (no torch.compile: starts in seconds)")
    add_model_size(p)
    args = p.parse_args()
    allocator.reexec_with_tcmalloc()  # measure what lora-serve runs on (LORA_SERVE_ALLOCATOR=system: glibc's)
    engine_thread.call(torch.set_num_threads, args.threads)
    print(cpu_report.describe(args.threads))
    model = sized_checkpoint(args.model_size)
    names = [f"a{i}" for i in range(8)]
    adapters = write_lora_adapters(model, Path(tempfile.mkdtemp()), names)

    def build() -> Engine:
        engine = Engine(EngineConfig(model=str(model), dtype="float32", max_num_seqs=max(args.batches),
                                     max_seq_len=args.prompt_len + args.steps + 64, max_num_batched_tokens=512,
                                     max_loras_per_batch=8, max_lora_rank=16, compile=not args.no_compile))
        register_adapters(engine, adapters)
        engine.warmup()
        return engine

    engine = engine_thread.call(build)
    for batch in args.batches:
        for kind, which in (("base", [None]), ("8 adapters", names)):
            engine_thread.call(decode_step_time, engine, batch, which, 4, args.prompt_len)  # settle

            prof = profile(activities=[ProfilerActivity.CPU])
            step_s, _ = engine_thread.call(decode_step_time, engine, batch, which, args.steps, args.prompt_len,
                                           lambda: prof)
            fam = shares(prof, args.steps)
            total = sum(fam.values())
            parts = "  ".join(f"{k} {100 * v / total:4.1f}% ({1000 * step_s * v / total:5.1f} ms)"
                              for k, v in fam.items())
            print(f"batch {batch:3d} {kind:10s} step {1000 * step_s:7.1f} ms (profiled)  {parts}", flush=True)


if __name__ == "__main__":
    main()
