"""Our int8 weights beside OpenVINO GenAI's int8 export of the same model: base and one adapter, decode tokens/s.

    python -m benchmarks.openvino_peer [--batches 1 8 32] [--rounds 3] [--steps 16] [--no-compile] [--model-size tiny]
        (LORA_SERVE_OPENVINO_VENV: OpenVINO's virtual environment; LORA_SERVE_OPENVINO_MODEL: the export)

The real SmolLM2-135M-Instruct, dequantised (benchmarks.common.smollm2_dequantised), and one rank-16 adapter on all
seven projections (the one benchmarks.quantized writes). OpenVINO: `optimum-cli export openvino --weight-format
int8` of that directory (int8 per output channel, asymmetric), run by benchmarks/openvino_peer_worker.py in its own
virtual environment (how to install it and export: that file's docstring), LLMPipeline on the CPU, its prefix cache
off (it is not keyed by adapter), the batch's prompts prefilled in one step. OpenVINO applies one adapter to a whole
batch (a batch of different adapters gets the first one's weights: the worker's docstring), so one adapter is what
both systems run. Ours: compiled engines in bfloat16 where the CPU has it (float32 elsewhere), the weights
quantized at load to int8 per row (`--quantization int8`) and at full width. 64-token prompts; ours: batch / the
mean decode step (benchmarks.common.decode_step_time); OpenVINO: batch x 31 / (generate time - TTFT) for 32 new
tokens, from its own perf metrics. Systems in turn within each round, medians over rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from benchmarks import cpu_report
from benchmarks.common import add_model_size, sized_checkpoint, smollm2_dequantised, write_lora_adapters
from benchmarks.quantized import PROMPT, our_engine, our_speed, table
from lora_compile.config import resolve_dtype
from lora_serve_demo import default_cache_dir
from service import allocator
from service.runner import engine_thread

WORKER = Path(__file__).with_name("openvino_peer_worker.py")
ADAPTER = "q0"


def openvino(venv: Path, export: Path, adapter: Path, batch: int, threads: int) -> dict[str, float]:
    """One run of the worker at `batch`: {"base": tok/s, "one adapter": tok/s}."""
    out = subprocess.run([str(venv / "bin" / "python"), str(WORKER), "--model-dir", str(export),
                          "--adapter", str(adapter), "--batch", str(batch), "--prompt-len", str(PROMPT),
                          "--new-tokens", "32", "--rounds", "1", "--threads", str(threads)],
                         capture_output=True, text=True, env={k: v for k, v in os.environ.items()
                                                              if k not in ("PYTHONPATH", "LD_PRELOAD")})
    if out.returncode:
        raise RuntimeError(f"OpenVINO worker failed: {out.stderr[-2000:]}")
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    speeds = {r["kind"]: r["decode_tok_s"] for r in records if "decode_tok_s" in r}
    check = next(r for r in records if r["kind"] == "adapter-check")
    if not check["prompts_changed_by_adapter"]:
        print(f"OpenVINO at batch {batch}: the adapter changed no prompt's tokens", flush=True)
    return {"base": speeds["base"], "one adapter": speeds["adapter"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-compile", action="store_true", help="eager engines (no torch.compile: start in seconds)")
    add_model_size(p)
    args = p.parse_args()
    allocator.reexec_with_tcmalloc()
    engine_thread.call(torch.set_num_threads, args.threads)
    dtype = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    print(cpu_report.describe(args.threads), f"dtype {dtype}", flush=True)
    venv, export = os.environ.get("LORA_SERVE_OPENVINO_VENV"), os.environ.get("LORA_SERVE_OPENVINO_MODEL")
    if args.model_size == "smollm2-135m":
        model = smollm2_dequantised()
        adapters = write_lora_adapters(model, default_cache_dir() / "bench" / "smollm2-adapters", [ADAPTER])
    else:  # (its adapter's shapes are its own: not in the shared adapter directory)
        model = sized_checkpoint(args.model_size)
        adapters = write_lora_adapters(model, Path(tempfile.mkdtemp()), [ADAPTER])
    engines = {form: engine_thread.call(our_engine, model, dtype, form, max(args.batches), adapters, 1, None,
                                        not args.no_compile)
               for form in ("int8", "none")}
    labels = {"int8": f"ours {dtype}, int8 per row at load", "none": f"ours {dtype}, full width"}
    samples: dict[str, dict[int, list[float]]] = {}

    def add(name: str, batch: int, value: float) -> None:
        samples.setdefault(name, {}).setdefault(batch, []).append(value)

    for _ in range(args.rounds):
        for batch in args.batches:
            if venv and export:
                for kind, value in openvino(Path(venv), Path(export), adapters[ADAPTER], batch,
                                            args.threads).items():
                    add(f"OpenVINO GenAI, int8, {kind}", batch, value)
            for form, engine in engines.items():
                for kind, which in (("base", [None]), ("one adapter", [ADAPTER])):
                    add(f"{labels[form]}, {kind}", batch,
                        engine_thread.call(our_speed, engine, batch, which, args.steps))
    if not (venv and export):
        print("OpenVINO skipped: set LORA_SERVE_OPENVINO_VENV and LORA_SERVE_OPENVINO_MODEL")
    rows = {name: {b: statistics.median(v) for b, v in by_batch.items()} for name, by_batch in samples.items()}
    ref = "OpenVINO GenAI, int8, base" if venv and export else None
    table("SmolLM2-135M-Instruct, int8 weights", args.batches, rows, ref)


if __name__ == "__main__":
    main()
