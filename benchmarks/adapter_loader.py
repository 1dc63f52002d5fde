"""Does reading adapters on the loader threads slow the engine's steps? Decode step time at batch 8 (compiled,
SmolLM2-135M-shaped, in the engine thread) while the loader reads adapters back to back, against no reads.

    python -m benchmarks.adapter_loader [--adapters 64] [--rounds 5] [--threads 2] [--no-compile] [--model-size tiny]

Rounds alternate idle / loading (interleaved, medians). Then, last because its effect outlasts it, the same
reads done the way the engine thread used to do them (safetensors' torch reader, `.float()`, torch checks and
scaling) on a side thread, and the idle step once more after that: torch ops on a second thread give it an OpenMP
team of its own, which the engine thread pays for from then on (service/runner/engine_thread.py).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors import safe_open

import service.runner.engine_thread as engine_thread
from benchmarks.common import add_model_size, decode_step_time, sized_checkpoint
from benchmarks.many_adapters import write_adapters
from lora_compile import Engine, EngineConfig


class Reader:
    """Reads adapters back to back on `threads` threads until stopped; counts the reads."""

    def __init__(self, read, paths: list[Path], threads: int):
        self._read, self._paths = read, paths
        self._stop = threading.Event()
        self.reads = 0
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def _run(self, offset: int) -> None:
        i = offset
        while not self._stop.is_set():
            path = self._paths[i % len(self._paths)]
            self._read(path.name, path)
            self.reads += 1
            i += len(self._threads)

    def __enter__(self):
        self.t0 = time.perf_counter()
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join()
        self.seconds = time.perf_counter() - self.t0


def torch_read(_name: str, path: Path) -> None:
    """The engine thread's former read: torch tensors, float(), isfinite and scaling as torch ops."""
    with safe_open(str(path / "adapter_model.safetensors"), framework="pt", device="cpu") as f:
        for key in f.keys():
            t = f.get_tensor(key).float()
            assert torch.isfinite(t).all()
            (t * 2.0).contiguous()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--adapters", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2, help="loader threads")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--no-compile", action="store_true", help="eager engine (no torch.compile: starts in seconds)")
    add_model_size(p)
    args = p.parse_args()
    model = sized_checkpoint(args.model_size)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        names = write_adapters(model, root, args.adapters)
        paths = [root / n for n in names]
        engine = engine_thread.call(Engine, EngineConfig(model=str(model), max_batch_size=8, max_seq_len=512,
                                                         adapter_dirs=(str(root),), compile=not args.no_compile))
        engine_thread.call(engine.warmup)
        read = engine.adapters.read  # what the loader threads run

        def step() -> float:
            return engine_thread.call(decode_step_time, engine, 8, [None], args.steps)[0]

        step()
        idle, loading, rates = [], [], []
        for _ in range(args.rounds):
            idle.append(step())
            with Reader(read, paths, args.threads) as r:
                loading.append(step())
            rates.append(r.reads / r.seconds)
            print(f"  round: idle {1e3 * idle[-1]:.1f} ms, loading {1e3 * loading[-1]:.1f} ms", flush=True)
        mi, ml = statistics.median(idle), statistics.median(loading)
        print(f"CPU: {torch.get_num_threads()} torch threads; {'eager' if args.no_compile else 'compiled'} decode step "
              f"at batch 8, median of {args.rounds} interleaved rounds")
        print(f"  no adapter reads:                    {1e3 * mi:.1f} ms")
        print(f"  loader reading ({args.threads} threads, numpy): {1e3 * ml:.1f} ms  ({ml / mi:.2f}x; "
              f"{statistics.median(rates):.0f} adapters/s read)")
        with Reader(torch_read, paths, args.threads) as r:
            torch_side = step()
        after = statistics.median(step() for _ in range(3))
        print(f"  side threads reading with torch ops: {1e3 * torch_side:.1f} ms  ({torch_side / mi:.2f}x; "
              f"{r.reads / r.seconds:.0f} adapters/s read)")
        print(f"  no reads, after torch ran on side threads: {1e3 * after:.1f} ms  ({after / mi:.2f}x)")


if __name__ == "__main__":
    main()
