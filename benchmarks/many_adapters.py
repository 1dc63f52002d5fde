"""Many adapters served on demand: 1000 small adapters in an --adapter-dir, Poisson arrivals, adapters drawn Zipf
(alpha 1) or uniform, against one real lora-serve process (compiled, SmolLM2-135M-shaped checkpoint).

    python -m benchmarks.many_adapters [--quick] [--num-requests 300] [--rate 3] [--adapters 1000] [--no-compile]
                                       [--model-size tiny]

The adapters (rank 8 and 16 alternating, q_proj + v_proj, float16) are generated deterministically into a
temporary directory. One server runs every phase, interleaved in one process so the ratios share the machine's
state; each phase uses its own names (links inside the directory to the same files), so each starts cold:
  eight     requests over 8 adapters (Zipf), read on their first use      — the throughput reference
  zipf      requests over all adapters, Zipf alpha 1, cold                — loads while streams run
  warm      the zipf phase's requests again, their adapters prefetched    — the ITL reference
  uniform   requests over all adapters, uniform, cold                     — mostly cold, host evictions
The zipf and warm phases send the same requests at the same times, so they are also compared request by request
(the running streams' gaps while those requests were admitted; the TTFT the cold read added). Prints throughput,
TTFT P50/P95 split by cold (first request of its adapter in the phase) and warm, ITL P95 of
the gaps that overlap an adapter read vs the warm phase's ITL P95, cold TTFT against its adapter's read time + 2
steps, and the loads and evictions of each phase (from the server's DEBUG adapter-event lines).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import add_model_size, percentile, sized_checkpoint
from benchmarks.load import StreamRecord, draw_adapter, grpc_stream, open_loop, poisson_gaps
from benchmarks.server import ServerProcess, lora_serve
from service.client import AsyncLoraServeClient

MODULES = ("q_proj", "v_proj")
_EVENT = re.compile(r"adapter event (\w+) (\S+) start_ns=(\d+) end_ns=(\d+) bytes=(\d+)")


def write_adapters(base: Path, root: Path, count: int) -> list[str]:
    """`count` PEFT adapters t0000.. under root, float16, seeded by index (numpy: fast and deterministic)."""
    from safetensors.numpy import save_file

    cfg = json.loads((base / "config.json").read_text())
    h = cfg["hidden_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    outs = {"q_proj": h, "v_proj": kv}
    names = []
    for i in range(count):
        name, rank = f"t{i:04d}", 8 if i % 2 == 0 else 16
        rng = np.random.default_rng(i)
        tensors = {}
        for layer in range(cfg["num_hidden_layers"]):
            for m in MODULES:
                key = f"base_model.model.model.layers.{layer}.self_attn.{m}"
                tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, h)) * h ** -0.5).astype(np.float16)
                tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((outs[m], rank)) * 0.01).astype(np.float16)
        out = root / name
        out.mkdir(parents=True)
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        (out / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
            "target_modules": list(MODULES), "bias": "none"}))
        names.append(name)
    return names


def alias(root: Path, prefix: str, names: list[str]) -> list[str]:
    """Names `<prefix>-tNNNN` for the same files (relative links inside the directory: allowed)."""
    out = []
    for name in names:
        (root / f"{prefix}-{name}").symlink_to(name, target_is_directory=True)
        out.append(f"{prefix}-{name}")
    return out


def first_uses(specs) -> list[bool]:
    """Per request: whether it is the first of its adapter in the phase (a cold one: its adapter is read then)."""
    seen: set[str] = set()
    out = []
    for _, adapter, _ in specs:
        out.append(adapter not in seen)
        seen.add(adapter)
    return out


async def run_phase(target: str, specs, rate: float, seed: int) -> tuple[list[StreamRecord], float]:
    """The phase's requests at Poisson arrivals; wall-clock times (time.time), to set beside the server's adapter
    events."""
    async with AsyncLoraServeClient(target) as client:
        return await open_loop(lambda spec: grpc_stream(client, *spec, clock=time.time), specs,
                               poisson_gaps(random.Random(seed), rate, len(specs)))


async def prefetch(target: str, names: list[str]) -> None:
    async with AsyncLoraServeClient(target) as client:
        for name in sorted(set(names)):
            await client.load_adapter(name)


class ServerLog:
    """The server's adapter events (wall-clock ns), parsed from its output lines."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, int, int, int]] = []

    def feed(self, line: str) -> None:
        m = _EVENT.search(line)
        if m:
            self.events.append((m[1], m[2], int(m[3]), int(m[4]), int(m[5])))


def start_server(model: Path, adapter_dir: Path, args) -> tuple[ServerProcess, ServerLog]:
    log = ServerLog()
    server = lora_serve(model, "--max-seq-len", "512", "--max-batch-size", str(args.max_batch_size),
                        "--adapter-dir", str(adapter_dir), "--max-cpu-lora-bytes", str(args.max_cpu_lora_bytes),
                        "--max-queue", str(args.num_requests), "--log-level", "DEBUG",
                        *(["--no-compile"] if args.no_compile else []), http=False, on_line=log.feed)
    return server, log


def specs_for(names: list[str], zipf: float, args, seed: int):
    rng = random.Random(seed)
    return [([rng.randrange(3, 500) for _ in range(rng.randint(16, 64))], draw_adapter(rng, names, zipf),
             rng.randint(args.min_output, args.max_output)) for _ in range(args.num_requests)]


def summarize(label: str, results: list[StreamRecord], cold_flags: list[bool], duration: float, events,
              warm_itl_p95: float | None, step: float | None) -> dict:
    ok = [(r, cold) for r, cold in zip(results, cold_flags) if r.error is None]
    errors = [r.error for r in results if r.error]
    tokens = sum(r.output_tokens for r, _ in ok)
    loads = [(name, s / 1e9, e / 1e9) for kind, name, s, e, _ in events if kind == "load"]
    load_of = {name: e - s for name, s, e in loads}
    gaps_all, gaps_loading = [], []
    for r, _ in ok:
        for a, b in zip(r.token_times, r.token_times[1:]):
            gaps_all.append(b - a)
            if any(s < b and a < e for _, s, e in loads):
                gaps_loading.append(b - a)
    cold = [r.ttft for r, first in ok if first]
    warm = [r.ttft for r, first in ok if not first]
    count = {k: sum(1 for e in events if e[0] == k) for k in ("load", "load_failed", "evict_host", "evict_device",
                                                              "device_copy")}
    out = {"label": label, "ok": len(ok), "errors": len(errors), "duration": duration, "tok_s": tokens / duration,
           "itl_p95": percentile(gaps_all, 95), "itl_p95_loading": percentile(gaps_loading, 95),
           "n_loading_gaps": len(gaps_loading), **count}
    print(f"--- {label}: {len(ok)} ok, {len(errors)} failed{' (' + errors[0] + ')' if errors else ''}; "
          f"{duration:.1f}s; {tokens / duration:.1f} output tok/s, {len(ok) / duration:.2f} req/s")
    print(f"    TTFT ms cold (n={len(cold)}): P50 {1e3 * percentile(cold, 50):.0f} P95 {1e3 * percentile(cold, 95):.0f}; "
          f"warm (n={len(warm)}): P50 {1e3 * percentile(warm, 50):.0f} P95 {1e3 * percentile(warm, 95):.0f}")
    print(f"    ITL P95 ms: all {1e3 * out['itl_p95']:.1f}; during adapter reads {1e3 * out['itl_p95_loading']:.1f} "
          f"(n={len(gaps_loading)})" + (f"; / warm P95 = {out['itl_p95_loading'] / warm_itl_p95:.2f}x"
                                         if warm_itl_p95 and gaps_loading else ""))
    print(f"    loads {count['load']} (failed {count['load_failed']}), read ms P50 "
          f"{1e3 * percentile(list(load_of.values()), 50):.1f} P95 {1e3 * percentile(list(load_of.values()), 95):.1f}; "
          f"device copies {count['device_copy']}; evictions host {count['evict_host']} device {count['evict_device']}")
    if step and load_of:
        slack = [(r.ttft - load_of[r.adapter]) / step for r, first in ok if first and r.adapter in load_of]
        within = sum(1 for x in slack if x <= 2)
        out["cold_within"] = within / max(1, len(slack))
        print(f"    cold TTFT - its read time, in steps ({1e3 * step:.1f} ms): P50 {percentile(slack, 50):.1f} "
              f"P95 {percentile(slack, 95):.1f}; within read + 2 steps: {within}/{len(slack)}")
    return out


def window_gaps(results: list[StreamRecord], idxs: list[int]) -> list[float]:
    """Token gaps of the other streams that overlap requests `idxs`' arrival-to-first-token windows."""
    windows = [(results[i].start, results[i].start + results[i].ttft) for i in idxs]
    chosen = set(idxs)
    return [b - a for j, r in enumerate(results) if j not in chosen and r.error is None
            for a, b in zip(r.token_times, r.token_times[1:]) if any(s < b and a < e for s, e in windows)]


def paired_with_warm(cold_phase: list[StreamRecord], warm_phase: list[StreamRecord], cold_flags: list[bool],
                     step: float) -> None:
    """The same requests (same arrivals, prompts, adapters) cold and then prefetched: what the cold reads cost
    the running streams and the cold requests themselves, like for like (a new request's prefill lengthens the
    running streams' gaps in both runs; only the read differs)."""
    idxs = [i for i, (c, w, first) in enumerate(zip(cold_phase, warm_phase, cold_flags))
            if first and c.error is None and w.error is None]
    cold_gaps, warm_gaps = window_gaps(cold_phase, idxs), window_gaps(warm_phase, idxs)
    extra = [(cold_phase[i].ttft - warm_phase[i].ttft) / step for i in idxs]
    print(f"    same requests cold vs prefetched (n={len(idxs)}): running streams' ITL P95 while they were admitted "
          f"{1e3 * percentile(cold_gaps, 95):.1f} vs {1e3 * percentile(warm_gaps, 95):.1f} ms "
          f"({percentile(cold_gaps, 95) / percentile(warm_gaps, 95):.2f}x); TTFT added by the cold read, in steps: "
          f"P50 {percentile(extra, 50):.1f} P95 {percentile(extra, 95):.1f}; "
          f"within 2 steps: {sum(1 for x in extra if x <= 2)}/{len(extra)}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="60 requests per phase, 200 adapters (a smoke run)")
    p.add_argument("--adapters", type=int, default=1000)
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--rate", type=float, default=3.0, help="requests/s (Poisson)")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=48)
    p.add_argument("--max-cpu-lora-bytes", type=int, default=1 << 30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-compile", action="store_true", help="serve eagerly (starts in seconds)")
    add_model_size(p)
    p.add_argument("--phases", default="eight,zipf,warm,uniform",
                   help="which phases to run (zipf and warm are compared request by request)")
    args = p.parse_args()
    wanted = set(args.phases.split(","))
    if not wanted <= {"eight", "zipf", "warm", "uniform"} or "warm" not in wanted:
        p.error("--phases: a subset of eight,zipf,warm,uniform that includes warm (the step-time reference)")
    if args.quick:
        args.num_requests, args.adapters = 60, 200
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model = sized_checkpoint(args.model_size)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        base_names = write_adapters(model, root, args.adapters)
        size = sum(f.stat().st_size for f in root.rglob("*.safetensors"))
        print(f"{args.adapters} adapters written in {time.perf_counter() - t0:.1f}s ({size / 2**20:.0f} MiB on disk)")
        server, log = start_server(model, root, args)
        target = server.target
        try:
            print(f"lora-serve at {target}: batch {args.max_batch_size}, default max-loras-per-batch, host cache "
                  f"{args.max_cpu_lora_bytes / 2**20:.0f} MiB, rate {args.rate} req/s, {args.num_requests} requests "
                  f"per phase, CPU: {os.cpu_count()} cores")
            phases = {}
            eight = alias(root, "eight", base_names[:8])
            zipf = alias(root, "zipf", base_names)
            warm = alias(root, "warm", base_names)
            uniform = alias(root, "uniform", base_names)
            plan = [(label, names, alpha) for label, names, alpha in
                    [("eight", eight, 1.0), ("zipf", zipf, 1.0), ("warm", warm, 1.0), ("uniform", uniform, 0.0)]
                    if label in wanted]
            for label, names, alpha in plan:
                specs = specs_for(names, alpha, args, args.seed)  # the same draws in every phase
                if label == "warm":
                    asyncio.run(prefetch(target, [a for _, a, _ in specs]))
                    time.sleep(1)
                first = len(log.events)
                results, duration = asyncio.run(run_phase(target, specs, args.rate, args.seed))
                time.sleep(0.5)  # the last events' log lines
                phases[label] = (results, first_uses(specs), duration, log.events[first:])
            w = summarize("warm", *phases["warm"], None, None)
            step = statistics.median(b - a for r in phases["warm"][0] if r.error is None
                                     for a, b in zip(r.token_times, r.token_times[1:]))
            out = {"warm": w}
            for label in ("eight", "zipf", "uniform"):
                if label in phases:
                    out[label] = summarize(label, *phases[label], w["itl_p95"], step)
            print("--- ratios (one server, phases back to back)")
            for label in ("zipf", "uniform"):
                if label in out and "eight" in out:
                    print(f"    throughput {label}/eight {out[label]['tok_s'] / out['eight']['tok_s']:.2f}x")
            if "zipf" in phases:
                paired_with_warm(phases["zipf"][0], phases["warm"][0], phases["zipf"][1], step)
            for label in ("zipf", "uniform"):
                if label in out and out[label]["n_loading_gaps"]:
                    print(f"    ITL P95 during reads ({label}) / warm ITL P95: "
                          f"{out[label]['itl_p95_loading'] / w['itl_p95']:.2f}x")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
