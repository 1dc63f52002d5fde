"""Where a CUDA step goes, by kernel: the GPU's own records of decode steps (replayed graphs and the same steps
launched one kernel at a time) and of one prefill step, base model and 8 distinct adapters.

    python -m benchmarks.cuda_profile [--batches 8 64] [--steps 8] [--kernels auto] [--prefill 8 64] [--out DIR]

The Llama-3.2-1B-shaped random model of benchmarks.cuda, bfloat16, rank-16 adapters on all seven projections.
Per configuration: wall milliseconds a step, milliseconds of GPU kernel time a step (the kernels' durations
summed: below the wall time, the GPU waits on the host), kernels a step, and the kernels that take most of it,
grouped into families (GEMMs, Inductor's generated kernels, the rest). With --out, every kernel record (name,
start, duration) goes to DIR/kernels-KERNEL.json.gz, for a closer look where no GPU is at hand. benchmarks.cuda
--trace runs the same on its engines after timing them.
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import LLAMA_1B, decode_step_time, random_checkpoint, register_adapters, write_lora_adapters
from benchmarks.cuda import KINDS, PROMPT_LEN, prefill_step_time
from lora_compile import Engine, EngineConfig

# Kernel families by name: cuBLAS / CUTLASS GEMMs, Inductor's generated Triton kernels, torch's attention kernels.
FAMILIES = (("gemm", re.compile(r"gemm|cutlass_80|nvjet|cublas|splitK", re.I)),
            ("inductor", re.compile(r"^triton_(poi|red|per|tem)_")),
            ("attention", re.compile(r"sdpa|flash|fmha|attention", re.I)))


# CPU too: the kernels' records are the same, and the CPU-only build (the smoke test of this module) has no other.
ACTIVITIES = [ProfilerActivity.CPU, ProfilerActivity.CUDA]


def family(name: str) -> str:
    return next((f for f, pattern in FAMILIES if pattern.search(name)), "other")


def kernels(prof) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of every GPU kernel the profile recorded, from its trace (the one format every
    torch version writes alike)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    events = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"]
    return [(e["name"], float(e["ts"]), float(e.get("dur", 0.0))) for e in events]


def summarise(label: str, wall_s: float, records: list[tuple[str, float, float]], steps: int, top: int) -> None:
    busy = sum(d for _, _, d in records) / 1000 / steps
    by_family = Counter()
    by_name = Counter()
    counts = Counter()
    for name, _, dur in records:
        by_family[family(name)] += dur / 1000 / steps
        short = name[:90]
        by_name[short] += dur / 1000 / steps
        counts[short] += 1
    fams = "  ".join(f"{f} {ms:.3f}" for f, ms in by_family.most_common())
    print(f"{label}: wall {1000 * wall_s:.3f} ms/step, GPU kernels {busy:.3f} ms/step "
          f"({len(records) / steps:.0f} kernels/step); {fams}", flush=True)
    for name, ms in by_name.most_common(top):
        print(f"    {ms:7.3f} ms  x{counts[name] / steps:5.1f}  {name}")


def trace_engine(engine: Engine, label: str, batches: list[int], names: list[str],
                 prefills: list[tuple[int, int]], out: Path | None, steps: int = 8, top: int = 12) -> None:
    """Decode steps at each batch (replayed graphs, then the same steps launched kernel by kernel) and each prefill
    of (prompts, tokens), base model and 8 adapters: printed by family, every record written to
    out/kernels-<label>.json.gz."""
    records: dict[str, list] = {}
    graphs = engine._graphs
    try:
        for batch in batches:
            for kind in ("base", "8 adapters"):
                which = KINDS[kind](names)
                for graphed in ((True, False) if graphs is not None else (False,)):
                    engine._graphs = graphs if graphed else None
                    decode_step_time(engine, batch, which, 4, PROMPT_LEN)  # settle (captures the graph)
                    outs: list = []
                    wall, _ = decode_step_time(engine, batch, which, 2 * steps, PROMPT_LEN, outputs=outs)
                    host = {k: 1000 * sum(getattr(o, k) for o in outs) / len(outs)
                            for k in ("batch_init_s", "forward_s", "sample_s", "batch_init_ahead_s")}
                    prof = profile(activities=ACTIVITIES)
                    decode_step_time(engine, batch, which, steps, PROMPT_LEN, lambda: prof)
                    name = f"{label} decode b{batch} {kind} {'graphs' if graphed else 'no graphs'}"
                    records[name] = kernels(prof)
                    summarise(name, wall, records[name], steps, top)
                    print(f"    engine's split, ms a step: {'  '.join(f'{k[:-2]} {v:.3f}' for k, v in host.items())}")
    finally:
        engine._graphs = graphs
    for seqs, tokens in prefills:
        for kind in ("base", "8 adapters"):
            which = KINDS[kind](names)
            prefill_step_time(engine, seqs, which, tokens)  # first calls of these sizes
            wall = min(prefill_step_time(engine, seqs, which, tokens) for _ in range(3))
            with profile(activities=ACTIVITIES) as prof:
                prefill_step_time(engine, seqs, which, tokens)
            name = f"{label} prefill {seqs}x{tokens} {kind}"
            records[name] = kernels(prof)
            summarise(name, wall, records[name], 1, top)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        with gzip.open(out / f"kernels-{label}.json.gz", "wt") as f:
            json.dump(records, f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--kernels", nargs="+", default=["auto"], help="EngineConfig.lora_kernel, one engine each")
    p.add_argument("--prefill", type=int, nargs=2, action="append", metavar=("SEQS", "TOKENS"))
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the 1B model's 16)")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--out", type=Path, default=None, help="write every kernel record to OUT/kernels-KERNEL.json.gz")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks.cuda_profile: skipped (it needs a CUDA GPU; torch sees none)")
        return
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    shape = LLAMA_1B if args.layers is None else LLAMA_1B | {"num_hidden_layers": args.layers}
    model = random_checkpoint(f"llama-1b-shaped-bf16{'' if args.layers is None else f'-{args.layers}-layers'}",
                              shape, torch.bfloat16)
    names = [f"a{i}" for i in range(8)]
    with tempfile.TemporaryDirectory() as tmp:
        adapters = write_lora_adapters(model, Path(tmp), names)
        for kernel in args.kernels:
            engine = Engine(EngineConfig(model=str(model), device="cuda", dtype="bfloat16",
                                         max_num_seqs=max(args.batches), max_seq_len=512, max_num_batched_tokens=2048,
                                         max_loras_per_batch=8, max_lora_rank=16, lora_kernel=kernel))
            register_adapters(engine, adapters)
            t0 = time.perf_counter()
            engine.warmup()
            print(f"engine ({engine.lora_kernel} LoRA): warm-up {time.perf_counter() - t0:.1f}s", flush=True)
            trace_engine(engine, engine.lora_kernel, args.batches, names, args.prefill or [(8, 64)], args.out,
                         args.steps, args.top)
            del engine
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
