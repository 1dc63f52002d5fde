"""Uncached prefill: time to first token of long prompts, and what it costs the streams already decoding.

    python -m benchmarks.prefill [--dtype auto] [--lengths 256 1000 4000] [--rounds 3] [--vllm-venv DIR]
                                 [--forms sdpa:256 sdpa:512 inductor:256 sdpa:512:masked] [--no-itl] [--long 1000] [--no-compile]
                                 [--model-size tiny]

The SmolLM2-135M-shaped checkpoint (benchmarks.common) and 8 rank-16 adapters on all 7 projections. Every prompt
is new (seeded random ids, a new seed per measurement): nothing comes from a prefix cache. Measured, systems in
turn within each round, medians over rounds:
- cold TTFT of one prompt of each length (1 output token), base;
- the TTFT of 8 prompts of 1,000 tokens (--long) at once (until all have their first token), base and 8 distinct
  adapters;
- inter-token latency of 8 streams decoding (16-token prompts) while a 1,000-token (--long) prompt arrives: the P95 of
  the streams' gaps between tokens from its arrival until its first token (each gap counted once per stream), beside
  their median gap before it arrived;
- ours, once before the rounds: how far resident memory rises during a first prefill of the longest length.
Ours: compiled engines, one per --forms entry `prefill attention:max_num_batched_tokens[:lora kernel]` (sdpa, torch's fused
attention, the default; inductor, the generated reductions over the block table, the form before it), through the
bare engine in its thread. vLLM-CPU (--vllm-venv or LORA_SERVE_VLLM_VENV; skipped when absent): its offline engine
with LoRA on, defaults otherwise (its own chunk budget, prefix caching on), the same dtype, in a worker process of
its own environment (benchmarks.peers.VllmWorker); requests added at their times between its steps.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import cpu_report
from benchmarks.common import add_model_size, percentile, register_adapters, sized_checkpoint, write_lora_adapters
from benchmarks.peers import VllmWorker
from lora_compile import Engine, EngineConfig, SamplingParams, Sequence
from lora_compile.config import ModelConfig, resolve_dtype
from service import allocator
from service.runner import engine_thread

NAMES = [f"a{i}" for i in range(8)]
LONG = 1000        # the batch and the arrival measurements' prompt length (--long)
STREAMS = 8        # decoding while the long prompt arrives
STREAM_PROMPT = 16
ITL_GUESS_S = 0.05   # when vLLM's long prompt arrives: after about 16 of its decode steps
STREAM_TOKENS = 256  # outlast the long prompt's prefill (vLLM's worker gives every request the same limit)


def prompts(seed: int, length: int, n: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


class Ours:
    """One compiled engine; each call admits its requests, steps them through the bare engine, releases them."""

    def __init__(self, model: Path, adapters: dict[str, Path], dtype: str, prefill: str, budget: int,
                 max_len: int, compile: bool = True, lora_kernel: str = "auto"):
        def build() -> Engine:
            # inductor: both phases' reductions (compile_policy); sdpa: the default (prefill sdpa, CPU decode not)
            engine = Engine(EngineConfig(model=str(model), dtype=dtype, max_num_seqs=STREAMS + 1,
                                         max_seq_len=max_len, max_num_batched_tokens=budget,
                                         attention_backend="inductor" if prefill == "inductor" else "auto",
                                         max_loras_per_batch=8, max_lora_rank=16, enable_prefix_caching=False,
                                         lora_kernel=lora_kernel, compile=compile))
            register_adapters(engine, adapters)
            engine.warmup()
            return engine

        self.engine = engine_thread.call(build)
        self.ids = 0

    def _seqs(self, batch: list[list[int]], adapters: list[str | None], max_new: list[int]) -> list[Sequence]:
        out = []
        for p, a, n in zip(batch, adapters, max_new):
            self.ids += 1
            out.append(Sequence(self.ids, p, SamplingParams(max_new_tokens=n, ignore_eos=True), a))
        return out

    def ttft(self, batch: list[list[int]], adapters: list[str | None]) -> float:
        def run() -> float:
            seqs = self._seqs(batch, adapters, [1] * len(batch))
            t0 = time.perf_counter()
            for s in seqs:
                assert self.engine.try_admit(s)
            try:
                while pending := [s for s in seqs if not s.output_ids]:
                    self.engine.step(pending)
            finally:
                for s in seqs:
                    self.engine.release(s)
            return time.perf_counter() - t0
        return engine_thread.call(run)

    def arrival(self, streams: list[list[int]], long: list[int], before: int):
        """Token times of the streams, the long prompt's arrival and its first token's time (seconds from the
        start): it arrives after `before` steps."""
        def run():
            seqs = self._seqs(streams, [None] * len(streams), [STREAM_TOKENS] * len(streams))
            late = self._seqs([long], [None], [1])[0]
            times: list[list[float]] = [[] for _ in seqs]
            for s in seqs:
                assert self.engine.try_admit(s)
            running = list(seqs)
            t0, arrived_at, steps = time.perf_counter(), None, 0
            try:
                while not late.output_ids:
                    if arrived_at is None and steps == before:
                        arrived_at = time.perf_counter() - t0
                        assert self.engine.try_admit(late)
                        running.append(late)
                    counts = [len(s.output_ids) for s in seqs]
                    self.engine.step(running)
                    steps += 1
                    now = time.perf_counter() - t0
                    for i, s in enumerate(seqs):
                        times[i] += [now] * (len(s.output_ids) - counts[i])
            finally:
                for s in running:
                    self.engine.release(s)
            return times, arrived_at, time.perf_counter() - t0
        return engine_thread.call(run)


class Vllm:
    def __init__(self, venv: Path, model: Path, adapter_root: Path, dtype: str, max_len: int):
        self.worker = VllmWorker(venv, model, adapter_root, "lora", torch.get_num_threads(), max_model_len=max_len,
                                 dtype=dtype)

    def ttft(self, batch: list[list[int]], adapters: list[str | None]) -> float:
        reply = self.worker.replay(batch, adapters, 1, [0.0] * len(batch))
        return max(reply["ttft"])

    def arrival(self, streams: list[list[int]], long: list[int], at: float):
        reply = self.worker.replay(streams + [long], [None] * (len(streams) + 1), STREAM_TOKENS,
                                   [0.0] * len(streams) + [at])
        return reply["token_times"][:len(streams)], at, at + reply["ttft"][-1]


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_rss_growth_mib(run) -> float | None:
    """How far resident memory rose above where it stood while `run` ran (MiB): the peak is reset first (Linux's
    clear_refs 5), so what the process held before, other engines included, does not count. None where the kernel
    does not allow the reset."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    before = _status_kib("VmRSS")
    run()
    return (_status_kib("VmHWM") - before) / 1024


def gaps(times: list[list[float]], start: float, end: float) -> list[float]:
    """Each stream's gaps between consecutive tokens whose later token came in (start, end]."""
    return [b - a for t in times for a, b in zip(t, t[1:]) if start < b <= end]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1000, 4000])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--forms", nargs="+", default=["sdpa:256", "sdpa:512", "inductor:256"])
    p.add_argument("--no-itl", action="store_true", help="skip the arrival measurement")
    p.add_argument("--vllm-venv", default=os.environ.get("LORA_SERVE_VLLM_VENV"))
    p.add_argument("--long", type=int, default=LONG, help="the batch and the arrival measurements' prompt length")
    p.add_argument("--no-compile", action="store_true", help="eager engines (no torch.compile: start in seconds)")
    add_model_size(p)
    args = p.parse_args()
    allocator.reexec_with_tcmalloc()
    engine_thread.call(torch.set_num_threads, 2)
    dtype = str(resolve_dtype(args.dtype, torch.device("cpu"))).removeprefix("torch.")
    print(cpu_report.describe(2), f"dtype {dtype}", flush=True)
    model = sized_checkpoint(args.model_size)
    vocab = ModelConfig.from_dir(model).vocab_size
    max_len = max(*args.lengths, args.long, STREAM_PROMPT + STREAM_TOKENS) + 64
    tmp = Path(tempfile.mkdtemp())
    adapters = write_lora_adapters(model, tmp, NAMES)
    systems: dict[str, Ours | Vllm] = {}
    for form in args.forms:
        prefill, budget, *kernel = form.split(":")
        name = f"ours {prefill}, {budget}-token chunks" + (f", {kernel[0]} LoRA" if kernel else "")
        systems[name] = Ours(model, adapters, dtype, prefill, int(budget), max_len, not args.no_compile, *kernel)
    if args.vllm_venv:
        systems["vLLM-CPU"] = Vllm(Path(args.vllm_venv), model, tmp, dtype, max_len)
    else:
        print("vLLM-CPU skipped: no --vllm-venv / LORA_SERVE_VLLM_VENV", flush=True)
    for system in systems.values():  # warm: every path once
        system.ttft(prompts(-1, 64, 1, vocab), [None])
        system.ttft(prompts(-2, 64, 8, vocab), list(NAMES))
    # Before any long prompt has grown the heap: what a long prefill's temporaries take (in this process: ours).
    peaks = {name: peak_rss_growth_mib(lambda: system.ttft(prompts(-3, max(args.lengths), 1, vocab), [None]))
             for name, system in systems.items() if isinstance(system, Ours)}

    rows: dict[tuple[str, str], list[float]] = {}
    seed = 0
    for r in range(args.rounds):
        order = list(systems.items())
        for name, system in order[r % len(order):] + order[:r % len(order)]:  # each round begins with another
            for length in args.lengths:
                seed += 1
                rows.setdefault((name, f"TTFT {length}"), []).append(system.ttft(prompts(seed, length, 1, vocab),
                                                                                        [None]))
            for kind, which in (("base", [None] * 8), ("8 adapters", list(NAMES))):
                seed += 1
                rows.setdefault((name, f"TTFT 8x{args.long} {kind}"), []).append(
                    system.ttft(prompts(seed, args.long, 8, vocab), which))
            if not args.no_itl:
                seed += 1
                streams = prompts(seed, STREAM_PROMPT, STREAMS, vocab)
                long = prompts(seed + 1000, args.long, 1, vocab)[0]
                if isinstance(system, Ours):
                    times, at, end = system.arrival(streams, long, before=16)
                else:  # after about as long as 16 steps take ours (the two decode at speeds of the same order)
                    times, at, end = system.arrival(streams, long, 16 * ITL_GUESS_S)
                rows.setdefault((name, "ITL before"), []).append(statistics.median(gaps(times, 0, at)))
                rows.setdefault((name, "ITL P95 during"), []).append(percentile(gaps(times, at, end), 95))
    print()
    keys = list(dict.fromkeys(k for _, k in rows))
    print(f"{'':34s}" + "".join(f"{k:>22s}" for k in keys))
    for name in systems:
        print(f"{name:34s}" + "".join(f"{statistics.median(rows[(name, k)]):21.3f}s" for k in keys))
    for name, growth in peaks.items():
        print(f"{name}: peak resident memory during its first {max(args.lengths)}-token prefill: "
              + (f"+{growth:.0f} MiB over the warmed-up process's" if growth is not None else "not measurable here"))
    for name, system in systems.items():
        if isinstance(system, Vllm):
            system.worker.close()


if __name__ == "__main__":
    main()
