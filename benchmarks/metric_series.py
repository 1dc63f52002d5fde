"""Per-adapter /metrics series after requests naming 2,000 on-demand adapters (issue #31), against one real
lora-serve process (the demo model, eager) with a small host cache.

    python -m benchmarks.metric_series [--adapters 2000] [--host-adapters 16] [--max-loras-per-batch 8]

The adapters are one small PEFT adapter under 2,000 names (links inside the --adapter-dir). Every request names a
different adapter (1 new token); /metrics is scraped every --scrape-every requests. Prints the most
lora_serve:lora_adapter_resident series any scrape held against the bound (host cache + device slots), the series
of the whole scrape, and the time taken; exits 1 when a scrape held more than the bound.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.common import write_lora_adapter
from benchmarks.load import closed_loop
from benchmarks.server import ServerProcess, lora_serve
from lora_compile.lora.adapters import load_adapter
from lora_compile.config import ModelConfig
from lora_serve_demo import write_demo_checkpoint
from service.client import AsyncLoraServeClient


def start_server(model: Path, adapter_dir: Path, host_bytes: int, args) -> ServerProcess:
    return lora_serve(model, "--no-compile", "--adapter-dir", str(adapter_dir), "--max-cpu-lora-bytes", str(host_bytes),
                      "--max-loras-per-batch", str(args.max_loras_per_batch), "--max-queue", str(args.adapters))


def scrape(http_port: int) -> tuple[int, int]:
    """(lora_adapter_resident series, all series) of one /metrics scrape."""
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=30) as response:
        text = response.read().decode()
    resident = total = 0
    for family in text_string_to_metric_families(text):
        total += len(family.samples)
        if family.name == "lora_serve:lora_adapter_resident":
            resident = len(family.samples)
    return resident, total


async def run(server: ServerProcess, names: list[str], concurrency: int, scrape_every: int) -> list[tuple]:
    prompt = [1, 2, 3, 4]
    done, scrapes, scraping = 0, [], []

    async def scrape_at(n: int) -> None:
        scrapes.append((n, *await asyncio.to_thread(scrape, server.http_port)))

    async def one(client: AsyncLoraServeClient, name: str) -> None:
        nonlocal done
        await client.complete(prompt, adapter=name, max_new_tokens=1)
        done += 1
        if done % scrape_every == 0 or done == len(names):  # beside the load: a scrape holds no request's place
            scraping.append(asyncio.create_task(scrape_at(done)))

    async with AsyncLoraServeClient(server.target) as client:
        await closed_loop(lambda name: one(client, name), names, concurrency)
        await asyncio.gather(*scraping)
    return scrapes


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--adapters", type=int, default=2000)
    p.add_argument("--host-adapters", type=int, default=16, help="adapters the host cache's byte budget holds")
    p.add_argument("--max-loras-per-batch", type=int, default=8, help="device slots: adapters one step may hold")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--scrape-every", type=int, default=100)
    args = p.parse_args()
    model = write_demo_checkpoint()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "adapters"
        write_lora_adapter(model, root / "base", rank=8, seed=3, modules=("q_proj", "v_proj"))
        names = [f"tenant-{i:05d}" for i in range(args.adapters)]
        for name in names:
            (root / name).symlink_to("base", target_is_directory=True)
        size = load_adapter("base", root / "base", ModelConfig.from_dir(model), 16).nbytes
        server = start_server(model, root, args.host_adapters * size, args)
        try:
            t0 = time.perf_counter()
            scrapes = asyncio.run(run(server, names, args.concurrency, args.scrape_every))
            seconds = time.perf_counter() - t0
        finally:
            server.stop()
    bound = args.host_adapters + args.max_loras_per_batch
    most = max(resident for _, resident, _ in scrapes)
    print(json.dumps({
        "adapters_named": args.adapters, "seconds": round(seconds, 1),
        "requests_per_s": round(args.adapters / seconds, 1), "scrapes": len(scrapes),
        "max_resident_series": most, "bound": bound, "final_resident_series": scrapes[-1][1],
        "max_series_per_scrape": max(total for _, _, total in scrapes),
        "series_per_scrape": [(n, resident, total) for n, resident, total in scrapes]}, indent=1))
    sys.exit(0 if most <= bound else 1)


if __name__ == "__main__":
    main()
