"""Every benchmark runs: each `benchmarks/<name>.py` with a command-line entry point runs as `python -m
benchmarks.<name>` with its smallest arguments (the tiny checkpoint, eager engines, one round, a few tokens), exits 0
and prints its last figures. The benchmarks are listed from the directory, so a new one fails here until it is given
its smallest arguments below, or an exclusion with its reason.

Peers are hidden from the benchmarks (no vLLM, OpenVINO or llama.cpp environment variables): each runs its own part
and says in one line that it skipped the peer's. The CUDA benchmarks run where torch sees a GPU, and otherwise must
skip in one line."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
ENTRY_POINT = re.compile(r'^if __name__ == "__main__":', re.MULTILINE)
# Where a peer lives (docs/benchmarks.md): unset for the runs, so that each benchmark runs its own part only.
PEER_VARIABLES = ("LORA_SERVE_VLLM_VENV", "LORA_SERVE_OPENVINO_VENV", "LORA_SERVE_OPENVINO_MODEL",
                  "LORA_SERVE_LLAMA_CPP", "LORA_SERVE_LLAMA_CPP_BIN")
TIMEOUT_S = 600

# Scripts with an entry point that are not benchmarks of their own: each runs inside a peer's virtual environment
# (it imports the peer), started by the benchmarks that compare with that peer.
EXCLUDED = {
    "peer_vllm_worker": "vLLM's side of benchmarks.peers, prefill and prefix_cache: imports vllm, runs in its venv",
    "openvino_peer_worker": "OpenVINO's side of benchmarks.openvino_peer: imports openvino_genai, runs in its venv",
}


@dataclass(frozen=True)
class Run:
    args: tuple[str, ...]
    expect: str  # a regular expression for the last figures it prints: it got to the end


TINY = ("--model-size", "tiny")
EAGER_TINY = ("--no-compile", *TINY)
GPU = torch.cuda.is_available()

RUNS = {
    "activated_lora": Run(("--conversation-tokens", "40", "--rounds", "1", *EAGER_TINY),
                          r"median activated / cold: [\d.]+"),
    "adapter_mixes": Run(("--batches", "2", "--steps", "2", "--rounds", "1", "--no-peft", *EAGER_TINY),
                         r"a mix of 2 [\d.]+ ms"),
    "adapter_loader": Run(("--adapters", "2", "--rounds", "1", "--steps", "2", *EAGER_TINY),
                          r"no reads, after torch ran on side threads: +[\d.]+ ms"),
    "attention": Run(("--batches", "2", "--keys", "8", "--rounds", "1", "--no-compile"), r"gather \+ bmm +[\d.]+"),
    "burst": Run(("--streams", "2", "--rounds", "1", "--tokens", "4", *EAGER_TINY),
                 r"median service / engine: [\d.]+x"),
    # The subject is what torch.compile makes of three compile scopes: no eager form of it measures anything.
    "compile_scope": Run(("--batches", "2", "--steps", "2", "--rounds", "1", *TINY), r"8 adapters +[\d.]+ +[\d.]+"),
    "cuda": (Run(("--batches", "1", "--rounds", "1", "--steps", "4", "--kernels", "masked", "--no-peft",
                  "--prefill", "1", "64"), r"prefill step, prompts x tokens") if GPU
             else Run((), r"benchmarks\.cuda: skipped \(it needs a CUDA GPU")),
    "cuda_profile": (Run(("--batches", "1", "--steps", "2", "--layers", "1", "--top", "3"), r"prefill 8x64 8 adapters")
                     if GPU else Run((), r"benchmarks\.cuda_profile: skipped \(it needs a CUDA GPU")),
    "engine": Run(("--batches", "1", "--steps", "2", "--rounds", "1", *EAGER_TINY), r"(?m)^ +1 +[\d.]+ +[\d.]+"),
    "fair_share": Run(("--prompts", "2", "--tokens", "2", "--shares", "1.0", "--victims", "1", "--no-compile"),
                      r"the big call: +[\d.]+ s"),
    "gemm": Run(("--rows", "1"), r"(?m)^ +1 +[\d.]+ +[\d.]+"),
    "grammar_engines": Run(("--rounds", "1", *TINY), r"bitmask fill +[\d.]+ us/token"),
    "kv_capacity": Run(("--num-requests", "2", "--configs", "a", "--min-input", "8", "--max-input", "16",
                        "--min-output", "2", "--max-output", "4", "--adapters", "1", "--old-slots", "2",
                        "--old-seq-len", "64", *EAGER_TINY), r"a: +[\d.]+ out tok/s"),
    "lora": Run(("--batches", "2", "--steps", "2", "--rounds", "1", "--no-peft", *EAGER_TINY), r"[\d.]+% of step"),
    # What it counts is Inductor's code: compiled by nature (two 2-layer engines).
    "lora_kernel_count": Run(("--kernels", "stacked"), r"stacked +\d+ +\d+ +\+\d+ calls"),
    "lora_layer": Run(("--tokens", "9", "--rounds", "1", "--calls", "2", "--no-compile"),
                      r"B chunk-major, grouped order +[\d.]+"),
    # Two adapters: the steady-state measurement merges a0 again after the last one (a1) was merged.
    "lora_merge": Run(("--batch", "5", "--steps", "2", "--rounds", "1", "--adapters", "2", *EAGER_TINY),
                      r"merged/base speed [\d.]+x"),
    "lora_roofline": Run(("--tokens", "9", "--dtypes", "float32", "--copies", "1", "--rounds", "1", "--no-compile"),
                         r"[\d.]+ GMAC/s"),
    "many_adapters": Run(("--adapters", "2", "--num-requests", "3", "--rate", "50", "--phases", "zipf,warm",
                          "--min-output", "2", "--max-output", "3", *EAGER_TINY), r"same requests cold vs prefetched"),
    "metric_series": Run(("--adapters", "4", "--host-adapters", "1", "--max-loras-per-batch", "1", "--concurrency", "2",
                          "--scrape-every", "2"), r'"max_resident_series": \d+'),
    "noisy_neighbour": Run(("--settings", "server", "--tokens", "2", "--reps", "1", "--nices", "19", *EAGER_TINY),
                           r"beside nice 19: +[\d.]+ s"),
    "openvino_peer": Run(("--batches", "1", "--rounds", "1", "--steps", "2", *EAGER_TINY),
                         r"full width, one adapter +[\d.]+"),
    # This tree against itself: the benchmark needs another checkout to compare with.
    "paged_decode": Run(("--baseline", str(ROOT), "--batches", "2", "--pairs", "1", "--steps", "2", "--prompt-len", "8",
                         *EAGER_TINY), r"8 adapters batch 2 +[\d.]+ +\("),
    "peers": Run(("--batches", "1", "--rounds", "1", "--kinds", "base", "--model", "tiny", "--no-compile"),
                 r"decode +[\d.]+ tok/s"),
    "prefill": Run(("--lengths", "16", "--rounds", "1", "--forms", "sdpa:64", "--long", "32", *EAGER_TINY),
                   r"ours sdpa, 64-token chunks +[\d.]+s"),
    # Three requests at least: the rate is set from three lone requests.
    "prefix_cache": Run(("--num-requests", "3", "--rounds", "1", "--system-tokens", "32", "--adapters", "1",
                         "--new-tokens", "2", "--max-num-seqs", "2", *EAGER_TINY), r"TTFT on / off: P50 [\d.]+x"),
    # `demo` and `tiny` run the same comparison; the demo's is on SmolLM2-135M's file (several times the time).
    "quantized": Run(("tiny", "--batches", "1", "--steps", "1", "--no-compile"),
                     r"ours f32, dequantised, 8 adapters +[\d.]+"),
    "scaleout": Run(("--adapters", "2", "--requests", "3", "--concurrency", "1", "--rounds", "1",
                     "--warmup-rounds", "0"), r"\| 3, round-robin \| [\d.]+ \|"),
    "server_step": Run(("--tokens", "16", *EAGER_TINY), r"ITL seen by the clients: P50 [\d.]+ ms"),
    "serving": Run(("--num-requests", "3", "--adapters", "1", "--max-batch-size", "2", "--min-input", "4",
                    "--max-input", "8", "--min-output", "2", "--max-output", "4", "--rate", "0", *EAGER_TINY),
                   r"TTFT P95: served [\d.]+ ms"),
    "step_profile": Run(("--batches", "1", "--steps", "2", "--prompt-len", "8", *EAGER_TINY),
                        r"batch +1 8 adapters step +[\d.]+ ms"),
    "structured_output": Run(("--batch", "2", "--steps", "2", "--rounds", "1", *EAGER_TINY),
                             r"constrained / free tok/s: [\d.]+"),
    "tracing": Run(("--batch", "2", "--new-tokens", "4", "--rounds", "1", "--adapters", "1", *EAGER_TINY),
                   r"batch-init share of step time: [\d.]+%"),
    "vllm_bench_client": Run((), r"vLLM's bench client: skipped"),  # the whole comparison is vLLM's client
}


def entry_points() -> list[str]:
    """Every benchmarks/*.py that runs as a program."""
    return sorted(p.stem for p in BENCHMARKS.glob("*.py") if ENTRY_POINT.search(p.read_text()))


def test_every_benchmark_is_listed():
    """Each entry point has its smallest arguments or an exclusion, and nothing listed is gone."""
    names = set(entry_points())
    assert names - RUNS.keys() - EXCLUDED.keys() == set(), "give these benchmarks their smallest arguments in RUNS"
    assert (RUNS.keys() | EXCLUDED.keys()) - names == set(), "these are listed here but no longer benchmarks"
    assert RUNS.keys() & EXCLUDED.keys() == set()


def test_no_benchmark_imports_tests():
    """The benchmarks stand on their own: tests may use benchmarks' helpers (benchmarks.common), not the reverse."""
    for path in BENCHMARKS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                continue
            assert not any(m == "tests" or m.startswith("tests.") for m in modules), f"{path.name} imports {modules}"


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in entry_points() if n in RUNS])
def test_benchmark_runs(name):
    run = RUNS[name]
    env = {k: v for k, v in os.environ.items() if k not in PEER_VARIABLES}
    # glibc's malloc: a benchmark (and lora-serve) would otherwise start a second interpreter with TCMalloc preloaded,
    # a few seconds each, for figures nobody reads here.
    env |= {"LORA_SERVE_ALLOCATOR": "system", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *run.args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    output = f"--- stdout\n{done.stdout[-6000:]}\n--- stderr\n{done.stderr[-6000:]}"
    assert done.returncode == 0, f"benchmarks.{name} exited with {done.returncode}\n{output}"
    assert re.search(run.expect, done.stdout), f"benchmarks.{name} did not print /{run.expect}/\n{output}"
