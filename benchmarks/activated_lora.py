"""Activated LoRA (alora_invocation_tokens): one conversation answered by the base model and then by two activated
adapters prefills the conversation once.

    python -m benchmarks.activated_lora [--conversation-tokens 1000] [--rounds 3] [--model-size tiny] [--no-compile]

A compiled lora-serve (HTTP, defaults) on the SmolLM2-135M-shaped checkpoint with two activated rank-16 adapters on
all 7 projections ("checker" and "rewriter", each its own 3-token invocation). Each round draws a new conversation
of seeded random token ids and sends, one at a time, one new token each (max_tokens 1, greedy: the latency is the
time to first token):
  1. the base model, the conversation + 8 tokens (cold: nothing of it is cached);
  2. "checker", the conversation + its invocation + 8 tokens; 3. "rewriter" likewise;
  4. "checker" on another new conversation of the same length (a cold prefill of the same size, for the ratio).
Prints each request's latency and usage.prompt_tokens_details.cached_tokens, the server's prefix-cache hits
(/metrics) over the round, and the activated adapters' TTFT over the cold one (goal: <= 0.2).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks import cpu_report
from benchmarks.common import add_model_size, sized_checkpoint, write_lora_adapter
from benchmarks.server import lora_serve

INVOCATIONS = {"checker": [7, 8, 9], "rewriter": [10, 11, 12]}


def write_activated(base: Path, root: Path) -> dict[str, Path]:
    out = {}
    for i, (name, invocation) in enumerate(INVOCATIONS.items()):
        path = write_lora_adapter(base, root / name, rank=16, seed=100 + i)
        config = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps(config | {"alora_invocation_tokens": invocation}))
        out[name] = path
    return out


def complete(url: str, model: str, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the one new token, cached prompt tokens)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    answer = json.loads(urllib.request.urlopen(request, timeout=3600).read())
    return time.perf_counter() - t0, answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def prefix_cache_hits(url: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=60).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if not line.startswith("#") and "prefix_cache_hits" in line.split("{")[0].split(" ")[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversation-tokens", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-compile", action="store_true")
    add_model_size(p)
    args = p.parse_args()
    print(cpu_report.describe(2))
    base = sized_checkpoint(args.model_size)
    rng = random.Random(0)
    ratios, rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        adapters = write_activated(base, Path(tmp))
        flags = ["--max-seq-len", str(args.conversation_tokens + 64),
                 "--adapter", *(f"{n}={p}" for n, p in adapters.items())]
        flags += ["--no-compile"] if args.no_compile else []
        with lora_serve(base, *flags) as server:
            url = f"http://127.0.0.1:{server.http_port}"
            model = json.loads(urllib.request.urlopen(f"{url}/v1/models").read())["data"][0]["id"]
            for r in range(args.rounds):
                conversation = [rng.randrange(20, 400) for _ in range(args.conversation_tokens)]
                fresh = [rng.randrange(20, 400) for _ in range(args.conversation_tokens)]
                tail = [rng.randrange(20, 400) for _ in range(8)]
                hits = prefix_cache_hits(url)
                base_s, base_cached = complete(url, model, conversation + tail)
                checker_s, checker_cached = complete(url, "checker", conversation + INVOCATIONS["checker"] + tail)
                rewriter_s, rewriter_cached = complete(url, "rewriter", conversation + INVOCATIONS["rewriter"] + tail)
                cold_s, cold_cached = complete(url, "checker", fresh + INVOCATIONS["checker"] + tail)
                hits = prefix_cache_hits(url) - hits
                ratio = max(checker_s, rewriter_s) / cold_s
                ratios.append(ratio)
                rows.append((r, base_s, base_cached, checker_s, checker_cached, rewriter_s, rewriter_cached, cold_s,
                             cold_cached, hits, ratio))
    print(f"conversation {args.conversation_tokens} tokens; latency of one new token, s (cached prompt tokens)")
    print("round | base, cold | checker | rewriter | checker, cold | prefix-cache hits (metrics) | activated / cold")
    for r, bs, bc, cs, cc, rs, rc, ks, kc, hits, ratio in rows:
        print(f"{r} | {bs:.3f} ({bc}) | {cs:.3f} ({cc}) | {rs:.3f} ({rc}) | {ks:.3f} ({kc}) | {hits:.0f} | {ratio:.3f}")
    print(f"median activated / cold: {statistics.median(ratios):.3f} (goal <= 0.2)")


if __name__ == "__main__":
    main()
