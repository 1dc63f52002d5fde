"""Shared benchmark pieces: the SmolLM2-135M-shaped random checkpoint and timing helpers."""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from lora_compile import Engine, SamplingParams, Sequence
from lora_serve_demo import default_cache_dir, write_demo_tokenizer

# SmolLM2-135M's shape (random weights: no hub access here, and speed does not depend on the values).
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True)
ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# The Llama-3.2-1B-like shape the GPU benchmarks use (benchmarks/cuda.py), untied head.
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                rms_norm_eps=1e-5, tie_word_embeddings=False)


# Two layers of SmolLM2's family (its head_dim and GQA group) and the demo tokenizer's 512 ids (the benchmarks' prompts
# are ids below 503): a checkpoint that loads and steps in well under a second, for checking that a benchmark runs
# (`--model-size tiny`, tests/test_benchmarks_run.py); its figures mean nothing.
TINY = SMOLLM2_135M | dict(hidden_size=192, intermediate_size=256, num_hidden_layers=2, num_attention_heads=3,
                           num_key_value_heads=1, vocab_size=512)
MODEL_SIZES = ("smollm2-135m", "tiny")


def smollm2_checkpoint(root: Path | None = None) -> Path:
    return random_checkpoint("smollm2-135m-shaped", SMOLLM2_135M, root=root)


def add_model_size(p: argparse.ArgumentParser) -> None:
    """--model-size: the benchmark's SmolLM2-135M model (the default: the figures docs/benchmarks.md records) or the
    tiny random one (a quick check that the benchmark runs)."""
    p.add_argument("--model-size", choices=MODEL_SIZES, default=MODEL_SIZES[0],
                   help="tiny: a 2-layer random checkpoint of SmolLM2's family instead, to check that the benchmark "
                        "runs (its figures mean nothing)")


def sized_checkpoint(size: str = MODEL_SIZES[0]) -> Path:
    """The random checkpoint of a --model-size."""
    return smollm2_checkpoint() if size == "smollm2-135m" else random_checkpoint("tiny-smollm2-family", TINY)


def smollm2_dequantised(root: Path | None = None) -> Path:
    """The real demo model (SmolLM2-135M-Instruct, Q4_1 GGUF) dequantised to a float32 safetensors directory, written
    once (by transformers' GGUF loading, which gives our engine's tokens: tests/test_real_demo.py): the same weights
    for peers that read only Hugging Face directories (vLLM-CPU) and for our engine."""
    import shutil

    from transformers import AutoModelForCausalLM

    from lora_compile.model.loader.source import ModelSource
    from lora_serve_demo.smollm2 import fetch_smollm2

    out = (root or default_cache_dir() / "bench") / "smollm2-135m-instruct-dequantised"
    if (out / "model.safetensors").is_file():
        return out
    path = fetch_smollm2()
    if path is None:
        raise SystemExit("SmolLM2 could not be fetched (see the log)")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: embeddings
    save_file(state, str(out / "model.safetensors"))  # (save_pretrained refuses a model loaded from GGUF)
    config = model.config.to_dict() | {"architectures": ["LlamaForCausalLM"], "dtype": "float32"}
    config.pop("quantization_config", None)  # (the weights are plain float32 now)
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
    tokenizer_dir = ModelSource.resolve(path).tokenizer_dir
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / file, out / file)
    return out


def random_checkpoint(name: str, shape: dict, dtype: torch.dtype = torch.float32, root: Path | None = None) -> Path:
    """A Llama checkpoint of `shape` (a config.json's sizes) with seeded random weights, written once under root."""
    out = (root or default_cache_dir() / "bench") / name
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "torch_dtype": str(dtype).removeprefix("torch."), "bos_token_id": 1, "eos_token_id": 2, **shape}
    if (out / "model.safetensors").is_file():
        if json.loads((out / "config.json").read_text()) != config:  # a size the weights do not depend on changed
            (out / "config.json").write_text(json.dumps(config))
        return out
    out.mkdir(parents=True, exist_ok=True)
    c = shape
    gen = torch.Generator().manual_seed(0)
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    head_dim = h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * shape[-1] ** -0.5).to(dtype)

    ones = torch.ones(h, dtype=dtype)
    tensors = {"model.embed_tokens.weight": (torch.randn(v, h, generator=gen) * 0.5).to(dtype), "model.norm.weight": ones}
    if not c["tie_word_embeddings"]:
        tensors["lm_head.weight"] = rand(v, h)
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
            p + "input_layernorm.weight": ones.clone(), p + "post_attention_layernorm.weight": ones.clone(),
        }
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    write_demo_tokenizer(out)  # ids stay below the vocabulary; the text is irrelevant here
    return out


def write_lora_adapter(base: Path, out: Path, *, rank: int, seed: int, modules=ALL_MODULES) -> Path:
    """A PEFT-format adapter with random non-zero A and B, written with safetensors (as peft saves it)."""
    cfg = json.loads((base / "config.json").read_text())
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    shapes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
              "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for m in modules:
            kind = "self_attn" if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            n_in, n_out = shapes[m]
            key = f"base_model.model.model.layers.{layer}.{kind}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * n_in ** -0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": list(modules), "bias": "none", "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "base_model_name_or_path": str(base)}))
    return out


def write_lora_adapters(base: Path, root: Path, names: list[str], rank: int = 16) -> dict[str, Path]:
    """One adapter per name under root (write_lora_adapter, seeded by its position), by name."""
    return {name: write_lora_adapter(base, root / name, rank=rank, seed=i) for i, name in enumerate(names)}


def register_adapters(engine: Engine, adapters: dict[str, Path]) -> None:
    for name, path in adapters.items():
        engine.adapters.register(name, str(path))


def decode_step_time(engine: Engine, batch: int, adapters: list[str | None], steps: int = 16,
                     prompt_len: int = 64, timed: Callable[[], AbstractContextManager] = nullcontext,
                     outputs: list | None = None, **sampling) -> tuple[float, float]:
    """Mean seconds per decode step at `batch` sequences (after prefill), and mean batch-init seconds.
    `timed()`: a context around the timed steps alone (a profiler, say). `outputs`: receives the timed steps'
    StepOutputs. `sampling`: more SamplingParams fields (a structured output, say)."""
    seqs = [Sequence(i, [(7 * i + j) % 500 + 3 for j in range(prompt_len)],
                     # room for the tokens of early finishers while a small step budget prefills the rest
                     SamplingParams(max_new_tokens=min(engine.config.max_seq_len - prompt_len, steps + 8 + batch * prompt_len),
                                    ignore_eos=True, **sampling), adapters[i % len(adapters)])
            for i in range(batch)]
    for s in seqs:
        assert engine.try_admit(s), "benchmark batch does not fit the engine's limits"
    try:
        while any(s.num_computed_tokens < len(s.prompt_ids) for s in seqs):
            engine.step(seqs)
        for _ in range(2):
            engine.step(seqs)
        init = 0.0
        with timed():
            t0 = time.perf_counter()
            for _ in range(steps):
                out = engine.step(seqs)
                init += out.batch_init_s
                if outputs is not None:
                    outputs.append(out)
            elapsed = time.perf_counter() - t0
    finally:
        for s in seqs:
            engine.release(s)
    return elapsed / steps, init / steps


# (prompt ids, adapter or None, max new tokens): one request of a load
RequestSpec = tuple[list[int], str | None, int]


@dataclass
class StepRecord:
    seconds: float
    running: int     # sequences the step ran (preempted ones excluded)
    waiting: int     # requests arrived and not running (preempted ones included)
    kv_usage: float  # engine.kv_cache.usage after the step
    kind: str = "decode"  # StepOutput.kind: "decode", "prefill" or "mixed"
    tokens: int = 0       # tokens it produced


@dataclass
class Replay:
    ttft: list[float]                 # per request: seconds from its arrival to its first token
    duration: float                   # seconds from the start to the last token
    output_tokens: int
    steps: list[StepRecord] = field(default_factory=list)
    preemptions: int = 0              # the engine's, during the run
    cached_tokens: int = 0            # prompt tokens served from the prefix cache (first admissions)
    prompt_tokens: int = 0

    def mean_running(self, at_load: bool = False) -> float:
        """Sequences running, averaged over time (each step weighted by its duration); at_load: over the steps
        while some request waited, i.e. while more work was there than ran."""
        steps = [s for s in self.steps if s.waiting or not at_load]
        total = sum(s.seconds for s in steps)
        return sum(s.running * s.seconds for s in steps) / total if total else float("nan")

    def decode_throughput(self) -> float:
        """Tokens per second of the decode-only steps (no prompt chunk in them): what batching more sequences
        speeds up, apart from the prefill work every configuration does alike."""
        steps = [s for s in self.steps if s.kind == "decode"]
        return sum(s.tokens for s in steps) / sum(s.seconds for s in steps) if steps else float("nan")


def replay(engine: Engine, specs: list[RequestSpec], times: list[float]) -> Replay:
    """The requests arriving at `times` (seconds from the start, ascending) through the bare engine, in this
    thread (the engine's): before every step each arrived request is admitted while it fits, first come first
    served, preempted ones first in line again (what a scheduler at best does, with no RPC and no other thread).
    Greedy, ignore_eos: every request produces its max new tokens."""
    seqs = [Sequence(i, list(p), SamplingParams(max_new_tokens=n, ignore_eos=True), a)
            for i, (p, a, n) in enumerate(specs)]
    waiting: deque[Sequence] = deque()
    running: list[Sequence] = []
    ttft = [math.nan] * len(seqs)
    steps: list[StepRecord] = []
    arrived, preemptions0 = 0, engine.num_preemptions
    t0 = time.perf_counter()
    try:
        while arrived < len(seqs) or waiting or running:
            now = time.perf_counter() - t0
            if not running and not waiting and times[arrived] > now:
                time.sleep(times[arrived] - now)
            while arrived < len(seqs) and times[arrived] <= time.perf_counter() - t0:
                waiting.append(seqs[arrived])
                arrived += 1
            while waiting and engine.try_admit(waiting[0]):
                running.append(waiting.popleft())
            if not running:
                if waiting:
                    raise RuntimeError(f"request {waiting[0].seq_id} cannot be admitted with nothing running")
                continue
            t_step = time.perf_counter()
            out = engine.step(running)
            now = time.perf_counter() - t0
            if out.preempted:  # back to the front of the line, oldest first (as Engine.generate does)
                gone = set(out.preempted)
                waiting.extendleft(reversed([q for q in running if q.seq_id in gone]))
                running = [q for q in running if q.seq_id not in gone]
            for seq_id in out.seq_ids:
                if math.isnan(ttft[seq_id]):
                    ttft[seq_id] = now - times[seq_id]
            steps.append(StepRecord(now - (t_step - t0), len(running), len(waiting), engine.kv_cache.usage,
                                    out.kind, len(out.token_ids)))
            engine.release_finished(running)
    finally:
        for seq in running:
            engine.release(seq)
    return Replay(ttft, time.perf_counter() - t0, sum(len(s.output_ids) for s in seqs), steps,
                  engine.num_preemptions - preemptions0, sum(s.num_cached_tokens for s in seqs),
                  sum(len(s.prompt_ids) for s in seqs))


def interleaved(measures: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Median of `rounds` measurements of each, taken in turn (A B C A B C ...), so that drift and noise
    on a shared machine hit every configuration alike."""
    samples: dict[str, list[float]] = {name: [] for name in measures}
    for _ in range(rounds):
        for name, measure in measures.items():
            samples[name].append(measure())
    return {name: statistics.median(values) for name, values in samples.items()}


def per_call_us(fn: Callable[[], object], calls: int, sync: Callable[[], object] | None = None) -> Callable[[], float]:
    """A measure for `interleaved`: microseconds per call of `fn`, over `calls` calls (`sync`: wait for a device
    before and after them)."""
    def measure() -> float:
        if sync:
            sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if sync:
            sync()
        return (time.perf_counter() - t0) / calls * 1e6
    return measure


def percentile(values: list[float], q: float) -> float:
    """The value at rank q% of the sorted values (NaN for none)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def fmt_row(cells, widths) -> str:
    return "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))


def proc_stat(path: str | Path) -> tuple[int, int] | None:
    """(parent pid, CPU time in clock ticks: utime + stime) from a /proc .../stat file; None once it is gone."""
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except OSError:
        return None
    return int(fields[1]), int(fields[11]) + int(fields[12])
