"""Another tenant's time to first token while one call of many prompts runs, with and without the per-call share
(--max-request-share), through a real `lora-serve` process serving the demo model.

    python -m benchmarks.fair_share [--prompts 300] [--tokens 32] [--shares 1.0 0.25] [--victims 5] [--no-compile]

Per share: a server started with `--max-request-share S`; one completions call with --prompts prompts (each its own
text, --tokens tokens, ignore_eos) starts; once its first tokens are out, --victims single-prompt streaming
requests arrive one after another, each measured from its send to its first token; then the big call's own time.
Share 1.0 is the behaviour before the share existed (a call may take every place).
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.request

from benchmarks.server import lora_serve


def _post(url: str, body: dict):
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=3600)


def _ttft(url: str, model: str) -> float:
    t0 = time.perf_counter()
    with _post(url, {"model": model, "prompt": "Hello there,", "max_tokens": 4, "stream": True,
                      "ignore_eos": True}) as response:
        for line in response:
            if line.startswith(b"data: {"):
                return time.perf_counter() - t0
    raise RuntimeError("no token came")


def run(share: float, prompts: int, tokens: int, victims: int, compile: bool = True) -> tuple[list[float], float]:
    server = lora_serve(None, "--max-request-share", str(share), *([] if compile else ["--no-compile"]))
    url = server.http_url
    try:
        model = json.loads(urllib.request.urlopen(f"{url}/v1/models").read())["data"][0]["id"]
        done: list[float] = []
        t0 = time.perf_counter()

        def big() -> None:
            body = {"model": model, "prompt": [f"Story {i}: once upon a time, in a land far away," for i in
                                               range(prompts)], "max_tokens": tokens, "ignore_eos": True}
            with _post(url, body) as response:
                response.read()
            done.append(time.perf_counter() - t0)

        caller = threading.Thread(target=big)
        caller.start()
        time.sleep(2.0)  # its prefill under way
        ttfts = [_ttft(url, model) for _ in range(victims)]
        caller.join()
        return ttfts, done[0]
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=300)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--shares", type=float, nargs="+", default=[1.0, 0.25])
    p.add_argument("--victims", type=int, default=5)
    p.add_argument("--no-compile", action="store_true", help="serve eagerly (fast start, slower steps)")
    args = p.parse_args()
    from benchmarks import cpu_report
    from service.cpu_budget import usable_cpus

    print(cpu_report.describe(usable_cpus()))
    print(f"one call of {args.prompts} prompts x {args.tokens} tokens; {args.victims} other requests after 2 s")
    for share in args.shares:
        ttfts, total = run(share, args.prompts, args.tokens, args.victims, not args.no_compile)
        print(f"  --max-request-share {share:<5} other tenant's TTFT: median {statistics.median(ttfts):6.2f} s, "
              f"worst {max(ttfts):6.2f} s   the big call: {total:6.1f} s", flush=True)


if __name__ == "__main__":
    main()
