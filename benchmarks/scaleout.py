"""Scale-out: adapter loads per request through HAProxy, 3 replicas with adapter affinity vs round-robin vs 1.

    python -m benchmarks.scaleout [--adapters 12 --zipf 1.0 --requests 90 --concurrency 6 --rounds 2]

Real processes on loopback: 3 lora-serve replicas (eager, the demo model's shape, random LoRA adapters) and three
HAProxy instances in front of them, run side by side on the same Zipf-distributed request sequence:
  - "1 replica":        the shipped deploy/haproxy/haproxy.cfg with one server;
  - "3, affinity":      the shipped config (balance hdr(x-adapter-id) + hash-type consistent);
  - "3, round-robin":   the same with `balance roundrobin`.
An adapter load is an `adapter.load` span (the request found its adapter outside the device slots and copied it
in), counted per replica from the OTLP spans each replica exports to this process. Scenarios alternate within
each round, so machine noise hits them alike. Needs haproxy (scripts/setup.sh installs it; absent, it says so and
stops).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks.common import write_lora_adapters
from benchmarks.haproxy import HAProxy, haproxy_binary
from benchmarks.load import closed_loop
from benchmarks.server import ServerProcess, lora_serve
from lora_serve_demo import write_demo_checkpoint
from service.client import AsyncLoraServeClient
from service.tools.otlp_receiver import GrpcReceiver, OtlpSink

REPLICAS = ("replica-1", "replica-2", "replica-3")


def zipf_adapters(names: list[str], n: int, exponent: float, seed: int) -> list[str]:
    rng = random.Random(seed)
    weights = [1 / (rank + 1) ** exponent for rank in range(len(names))]
    return rng.choices(names, weights, k=n)


async def run_load(target: str, adapters: list[str], concurrency: int, max_new_tokens: int) -> tuple[Counter, float]:
    """Every request through the proxy, `concurrency` at a time; returns requests per replica and the wall time."""
    async with AsyncLoraServeClient(target) as client:
        async def one(adapter: str) -> str:
            done = await client.complete("Once upon a time", adapter=adapter, max_new_tokens=max_new_tokens,
                                         ignore_eos=True, timeout=300)
            return done.replica_id

        replicas, wall = await closed_loop(one, adapters, concurrency)
    return Counter(replicas), wall


def start_replica(replica_id: str, model: Path, adapters: dict[str, Path], otlp_endpoint: str, args) -> ServerProcess:
    """One eager replica (fast start on 2 cores) exporting its spans to `otlp_endpoint`; not waited for."""
    flags = ["--no-compile", "--host", "127.0.0.1", "--replica-id", replica_id,
             *[a for name, path in adapters.items() for a in ("--adapter", f"{name}={path}")],
             "--tracing", "--max-loras-per-batch", str(args.max_loras_per_batch),
             "--max-batch-size", str(max(args.concurrency, 1)), "--max-seq-len", "256",
             "--max-queue", str(args.requests)]
    env = os.environ | {"PYTHONUNBUFFERED": "1", "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_endpoint,
                        "OTEL_METRICS_EXPORTER": "none", "OTEL_BSP_SCHEDULE_DELAY": "200"}
    return lora_serve(model, *flags, env=env, wait=False)


def count_spans(sinks: dict[str, OtlpSink], name: str) -> Counter:
    return Counter({r: sum(1 for s in sink.spans() if s.name == name) for r, sink in sinks.items()})


def wait_exported(sinks: dict[str, OtlpSink], expected: Counter, timeout: float = 60) -> None:
    """Until every served request's spans arrived (one `queue` span per admitted request)."""
    deadline = time.monotonic() + timeout
    while count_spans(sinks, "queue") != expected:
        if time.monotonic() > deadline:
            raise RuntimeError(f"spans missing: {count_spans(sinks, 'queue')} of {expected}")
        time.sleep(0.1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", type=int, default=12)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--requests", type=int, default=90, help="per scenario and round")
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=2)
    p.add_argument("--max-loras-per-batch", type=int, default=4, help="device adapter slots per replica")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup-rounds", type=int, default=1,
                   help="rounds run first and not counted: the first use of each adapter on each replica is a load "
                        "whatever the routing")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if haproxy_binary() is None:
        print("scale-out: skipped (haproxy is not installed: scripts/setup.sh installs it)")
        return

    work = Path(tempfile.mkdtemp(prefix="scaleout-"))
    model = write_demo_checkpoint()
    names = [f"a{i:02d}" for i in range(args.adapters)]
    adapters = write_lora_adapters(model, work / "adapters", names, rank=8)
    sinks = {r: OtlpSink() for r in REPLICAS}
    receivers = [GrpcReceiver(sinks[r]) for r in REPLICAS]
    replicas: list[ServerProcess] = []
    proxies: dict[str, HAProxy] = {}
    try:
        for r, rec in zip(REPLICAS, receivers, strict=True):  # started side by side, then waited for
            replicas.append(start_replica(r, model, adapters, rec.endpoint, args))
        for replica in replicas:
            replica.wait_ready(600)
        ports = {r: (replica.port, replica.http_port) for r, replica in zip(REPLICAS, replicas)}
        scenarios = {
            "1 replica": ({REPLICAS[0]: ports[REPLICAS[0]]}, str),
            "3, affinity": (ports, str),
            "3, round-robin": (ports, lambda cfg: cfg.replace("balance hdr(x-adapter-id)", "balance roundrobin")),
        }
        for label, (servers, edit) in scenarios.items():
            where = work / label.replace(" ", "").replace(",", "-")  # (a path HAProxy's config can name)
            where.mkdir()
            proxies[label] = HAProxy(servers, where, edit)
            for name in servers:
                proxies[label].wait_state(name, "UP", proxies[label].up_within())
        totals = {label: Counter() for label in scenarios}
        for rnd in range(-args.warmup_rounds, args.rounds):
            sequence = zipf_adapters(names, args.requests, args.zipf, args.seed + rnd)
            for label, proxy in proxies.items():
                before_q, before_l = count_spans(sinks, "queue"), count_spans(sinks, "adapter.load")
                served, wall = asyncio.run(run_load(proxy.target, sequence, args.concurrency, args.max_new_tokens))
                wait_exported(sinks, before_q + served)
                loads = count_spans(sinks, "adapter.load") - before_l
                if rnd < 0:
                    print(f"warm-up {label:15s}: {sum(loads.values()):4d} loads / {sum(served.values())} requests")
                    continue
                totals[label].update({"requests": sum(served.values()), "loads": sum(loads.values()), "wall": wall})
                print(f"round {rnd + 1} {label:15s}: {sum(loads.values()):4d} loads / {sum(served.values())} requests, "
                      f"{wall:5.1f} s; per replica {dict(sorted(served.items()))}", flush=True)
        print(f"\n{platform.processor() or platform.machine()}, {args.adapters} adapters zipf {args.zipf}, "
              f"{args.max_loras_per_batch} device slots per replica, concurrency {args.concurrency}, "
              f"{args.rounds} rounds x {args.requests} requests per scenario (alternated, after {args.warmup_rounds} "
              "uncounted warm-up rounds)")
        print("| scenario | adapter loads per request | vs 3, affinity | requests/s |")
        print("|---|---|---|---|")
        affinity = totals["3, affinity"]["loads"] / totals["3, affinity"]["requests"]
        for label, t in totals.items():
            per = t["loads"] / t["requests"]
            ratio = f"{per / affinity:.1f}x" if affinity else "-"
            print(f"| {label} | {per:.3f} | {ratio} | {t['requests'] / t['wall']:.1f} |")
    finally:
        for proxy in proxies.values():
            proxy.stop()
        for replica in replicas:
            replica.stop()
        for rec in receivers:
            rec.stop()


if __name__ == "__main__":
    main()
