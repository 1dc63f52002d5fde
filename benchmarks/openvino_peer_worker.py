"""OpenVINO GenAI peer for the side-by-side decode benchmark.

This script runs in its own virtualenv, outside the repository, and must not
import torch or anything from lora-serve.  It loads an OpenVINO IR export of
the benchmark model with ``openvino_genai.LLMPipeline`` on CPU, builds prompts
of exactly ``--prompt-len`` tokens, decodes ``--new-tokens`` tokens greedily
for a batch of ``--batch`` prompts and prints one JSON line per measurement:

    {"system": "openvino", "form": "int8", "kind": "base", "batch": 8,
     "decode_tok_s": ..., "ttft_s": ..., ...}

decode_tok_s = batch * (new_tokens - 1) / (total_s - ttft_s), where total_s
and ttft_s come from GenAI's own perf metrics (generate duration and time to
first token).  ``kind`` is ``base`` (pipeline built without adapters),
``adapter`` (pipeline built with the adapter, adapter applied) and
``base-in-lora-pipeline`` (same pipeline, empty AdapterConfig).

Setting up the peer (tested with Python 3.11, openvino 2026.4.1,
openvino-genai 2026.4.1.0, openvino-tokenizers 2026.4.1.0, optimum-intel 2.2.0,
optimum 2.3.0, nncf 3.4.0, transformers 5.5.4, torch 2.13.0+cpu):

    python3 -m venv ~/peers/openvino-venv
    ~/peers/openvino-venv/bin/pip install --find-links /opt/wheels torch==2.13.0
    ~/peers/openvino-venv/bin/pip install torch==2.13.0 openvino-genai \\
        openvino-tokenizers "optimum-intel[openvino]"
    # optimum-intel pulls a torchvision whose compiled ops do not match
    # torch 2.13 ("operator torchvision::nms does not exist"); the export
    # does not need it:
    ~/peers/openvino-venv/bin/pip uninstall -y torchvision

torch is only needed for the export; install the CPU wheel first so pip never
reaches for a CUDA build.  optimum-intel 2.2.0 caps transformers below 5.6.

The dequantised SmolLM2 checkpoint's tokenizer_config.json names no tokenizer
class, and transformers 5.5 then loads it as a CodeLlama (SentencePiece-style)
tokenizer, which yields a wrong OpenVINO tokenizer and detokenizer.  Export
from a staging directory that links the checkpoint and adds the class:

    S=~/.cache/lora-serve/bench/smollm2-135m-instruct-dequantised
    mkdir -p ~/peers/smollm2-src && cd ~/peers/smollm2-src
    ln -sf $S/model.safetensors $S/config.json $S/tokenizer.json .
    python3 -c "import json; c = json.load(open('$S/tokenizer_config.json')); \\
        c['tokenizer_class'] = 'PreTrainedTokenizerFast'; \\
        json.dump(c, open('tokenizer_config.json', 'w'), indent=2)"
    ~/peers/openvino-venv/bin/optimum-cli export openvino \\
        --model ~/peers/smollm2-src --task text-generation-with-past \\
        --weight-format int8 ~/peers/smollm2-openvino-int8

The export directory then holds openvino_model.xml/.bin (int8_asym
per-channel weights) plus openvino_tokenizer.xml and openvino_detokenizer.xml.

Example:

    ~/peers/openvino-venv/bin/python benchmarks/openvino_peer_worker.py \\
        --model-dir ~/peers/smollm2-openvino-int8 \\
        --adapter ~/.cache/lora-serve/bench/smollm2-adapters/q0 \\
        --batch 8 --prompt-len 128 --new-tokens 32 --rounds 3

Adapters are PEFT LoRA directories (adapter_config.json +
adapter_model.safetensors).  GenAI reads only the safetensors file and takes
the scale as the AdapterConfig alpha, so the PEFT scale lora_alpha / r is read
from adapter_config.json and passed as alpha (override with --alpha).

The paged attention backend (LLMPipeline's CPU default) enables prefix
caching unless told otherwise, and that cache ignores which adapter produced
the KV: the same prompt decoded first without and then with an adapter (or the
other way round) gives wrong tokens.  This worker always passes a
SchedulerConfig with enable_prefix_caching=False.

Limits of the peer: every prompt in one generate() call must use the same
adapter.  GenAI's batched path rejects a batch mixing adapter and no adapter
("LoRA adapters value must be the same for all requests"), and a batch whose
prompts name different adapters is accepted but decoded with the first
request's adapter for every prompt.  Only single-adapter batches are measured.
One adapter does apply to every prompt of a batch.

Each record also carries cpu_util (process CPU seconds / wall seconds) and
busy_threads (OS threads that ran for at least 10% of the wall time), which
show whether INFERENCE_NUM_THREADS was honoured; the final ``adapter-check``
record counts the prompts whose greedy output the adapter changed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import openvino_genai as og

WORD_POOL = (
    "time year people way day man thing woman life child world school state "
    "family student group country problem hand part place case week company "
    "system program question work government number night point home water "
    "room mother area money story fact month lot right study book eye job "
    "word business issue side kind head house service friend father power "
    "hour game line end member law car city community name president team "
    "minute idea kid body information back parent face others level office "
    "door health person art war history party result change morning reason "
    "research girl guy moment air teacher force education river garden stone"
).split()


def _thread_cpu_times() -> dict[str, float]:
    """CPU seconds (user + system) per OS thread of this process (Linux only)."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[tid] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
    return out


def _busy_threads(before: dict[str, float], after: dict[str, float], wall: float) -> int:
    """Threads that were on a CPU for at least 10% of the wall time."""
    return sum(1 for t, v in after.items() if v - before.get(t, 0.0) >= 0.1 * wall)


def single_token_words(tok: og.Tokenizer) -> list[str]:
    """Words whose leading-space form is exactly one token and round-trips."""
    words = []
    for w in dict.fromkeys(WORD_POOL):
        ids = tok.encode(" " + w, add_special_tokens=False).input_ids.data.tolist()[0]
        if len(ids) == 1 and tok.decode(ids, skip_special_tokens=False) == " " + w:
            words.append(w)
    if len(words) < 16:
        sys.exit(f"only {len(words)} single-token words found; tokenizer looks wrong")
    return words


def build_prompts(tok: og.Tokenizer, batch: int, prompt_len: int, seed: int = 0) -> list[str]:
    """Distinct prompts of exactly prompt_len tokens each, checked with the tokenizer."""
    words = single_token_words(tok)
    rng = random.Random(seed)
    prompts = []
    for _ in range(batch):
        text = "".join(" " + rng.choice(words) for _ in range(prompt_len))
        n = tok.encode(text, add_special_tokens=True).input_ids.get_shape()[1]
        if n != prompt_len:
            sys.exit(f"prompt built with {n} tokens, wanted {prompt_len}")
        prompts.append(text)
    return prompts


def resolve_adapter(path: str, alpha: float | None) -> tuple[Path, float]:
    p = Path(path).expanduser()
    cfg_dir = p if p.is_dir() else p.parent
    st = p / "adapter_model.safetensors" if p.is_dir() else p
    if not st.is_file():
        sys.exit(f"no adapter_model.safetensors at {p}")
    if alpha is None:
        alpha = 1.0
        cfg = cfg_dir / "adapter_config.json"
        if cfg.is_file():
            c = json.loads(cfg.read_text())
            r = c.get("r") or 0
            if r:
                alpha = float(c.get("lora_alpha", r)) / r
                if c.get("use_rslora"):
                    alpha = float(c.get("lora_alpha", r)) / r ** 0.5
    return st, alpha


def make_config(pipe: og.LLMPipeline, new_tokens: int) -> og.GenerationConfig:
    gc = pipe.get_generation_config()
    gc.max_new_tokens = new_tokens
    gc.min_new_tokens = new_tokens
    gc.do_sample = False
    gc.ignore_eos = True
    gc.apply_chat_template = False
    return gc


def measure(pipe, prompts, gc, rounds, base_record):
    batch = len(prompts)
    new_tokens = gc.max_new_tokens
    # Untimed warm-up: compiles kernels and sizes the KV cache for this batch.
    gc.max_new_tokens = gc.min_new_tokens = 2
    pipe.generate(prompts, gc)
    gc.max_new_tokens = gc.min_new_tokens = new_tokens
    per_round = []
    for _ in range(rounds):
        th0 = _thread_cpu_times()
        c0 = time.process_time()
        t0 = time.perf_counter()
        res = pipe.generate(prompts, gc)
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0
        th1 = _thread_cpu_times()
        pm = res.perf_metrics
        ttft = pm.get_ttft().mean / 1000.0
        total = pm.get_generate_duration().mean / 1000.0
        produced = pm.get_num_generated_tokens()
        decode_s = total - ttft
        per_round.append(
            {
                "decode_tok_s": batch * (new_tokens - 1) / decode_s if decode_s > 0 else None,
                "ttft_s": ttft,
                "total_s": total,
                "wall_s": wall,
                "tpot_ms": pm.get_tpot().mean,
                "genai_throughput_tok_s": pm.get_throughput().mean,
                "generated_tokens": produced,
                "cpu_util": cpu / wall if wall > 0 else None,
                "busy_threads": _busy_threads(th0, th1, wall),
            }
        )
    best = max(per_round, key=lambda r: r["decode_tok_s"] or 0.0)
    rec = dict(base_record)
    rec.update(
        decode_tok_s=statistics.median(r["decode_tok_s"] for r in per_round),
        decode_tok_s_best=best["decode_tok_s"],
        ttft_s=statistics.median(r["ttft_s"] for r in per_round),
        total_s=statistics.median(r["total_s"] for r in per_round),
        tpot_ms=statistics.median(r["tpot_ms"] for r in per_round),
        genai_throughput_tok_s=statistics.median(r["genai_throughput_tok_s"] for r in per_round),
        generated_tokens=per_round[-1]["generated_tokens"],
        expected_tokens=batch * new_tokens,
        cpu_util=round(statistics.median(r["cpu_util"] for r in per_round), 2),
        busy_threads=max(r["busy_threads"] for r in per_round),
        rounds=rounds,
    )
    print(json.dumps(rec), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True, help="OpenVINO IR export directory")
    ap.add_argument("--adapter", help="PEFT LoRA dir or its adapter_model.safetensors")
    ap.add_argument("--alpha", type=float, default=None,
                    help="LoRA scale passed to GenAI (default: lora_alpha / r from adapter_config.json)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="INFERENCE_NUM_THREADS")
    ap.add_argument("--attention-backend", choices=["default", "PA", "SDPA"], default="default",
                    help="GenAI attention backend: PA (paged, continuous batching; the CPU default) or SDPA")
    ap.add_argument("--form", default="int8", help="label for the weight format of the export")
    ap.add_argument("--skip-base", action="store_true", help="only measure the adapter")
    args = ap.parse_args()
    if args.new_tokens < 2:
        ap.error("--new-tokens must be at least 2")

    props: dict = {"INFERENCE_NUM_THREADS": args.threads}
    if args.attention_backend != "default":
        props["ATTENTION_BACKEND"] = args.attention_backend
    if args.attention_backend != "SDPA":
        # The paged (continuous batching) backend that LLMPipeline uses on CPU
        # turns prefix caching on by default.  Its cache is not keyed by
        # adapter, so a prompt seen with one adapter is then decoded from KV
        # computed with another (wrong tokens), and repeated rounds would
        # measure cache hits instead of prefill.  Turn it off, and let the
        # whole batch's prefill run in one step so that decode is timed alone.
        sc = og.SchedulerConfig()
        sc.enable_prefix_caching = False
        sc.max_num_seqs = max(256, args.batch)
        sc.max_num_batched_tokens = max(256, args.batch * (args.prompt_len + 1))
        props["scheduler_config"] = sc

    record = {
        "system": "openvino",
        "form": args.form,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "attention_backend": args.attention_backend,
        "prefix_caching": False,
        "openvino_genai": og.__version__.split("-")[0],
    }

    if not args.skip_base:
        t0 = time.perf_counter()
        pipe = og.LLMPipeline(args.model_dir, "CPU", **props)
        load_s = time.perf_counter() - t0
        prompts = build_prompts(pipe.get_tokenizer(), args.batch, args.prompt_len)
        measure(pipe, prompts, make_config(pipe, args.new_tokens), args.rounds,
                dict(record, kind="base", load_s=round(load_s, 2)))
        del pipe

    if args.adapter:
        st, alpha = resolve_adapter(args.adapter, args.alpha)
        adapter = og.Adapter(str(st))
        t0 = time.perf_counter()
        pipe = og.LLMPipeline(args.model_dir, "CPU", adapters=og.AdapterConfig(adapter), **props)
        load_s = time.perf_counter() - t0
        prompts = build_prompts(pipe.get_tokenizer(), args.batch, args.prompt_len)
        gc = make_config(pipe, args.new_tokens)
        gc.adapters = og.AdapterConfig(adapter, alpha)
        lora_res = measure(pipe, prompts, gc, args.rounds,
                           dict(record, kind="adapter", adapter=str(st.parent), alpha=alpha,
                                load_s=round(load_s, 2)))
        gc.adapters = og.AdapterConfig()
        base_res = measure(pipe, prompts, gc, args.rounds,
                           dict(record, kind="base-in-lora-pipeline"))
        changed = sum(a != b for a, b in zip(lora_res.texts, base_res.texts))
        print(json.dumps(dict(record, kind="adapter-check", prompts_changed_by_adapter=changed,
                              of=len(prompts))), flush=True)


if __name__ == "__main__":
    main()
