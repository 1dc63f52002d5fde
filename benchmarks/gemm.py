"""Why the engine runs CPU float32 linears on oneDNN-packed weights (and plain ones as (W @ x.T).T): GEMM time
for one decode step's weights, by row count.

    python -m benchmarks.gemm               # GEMM time by row count (bf16 packed where the CPU has bf16; --rows N..)
    python -m benchmarks.gemm --prefill     # the same at prefill sizes (65-513 rows)
    python -m benchmarks.gemm --dispatch    # what calling the packed GEMM as an op costs per call
    python -m benchmarks.gemm --bandwidth   # the machine's memory read speed: the floor of a weight-streaming step

The weights are those of the SmolLM2-135M shape (30 layers of qkv, o, gate_up, down, plus the 49152-row head):
all distinct, so nothing stays in cache, as in a real step.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from benchmarks.common import interleaved, per_call_us
from lora_compile.model import packed_gemm

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def step_ms(weights: list[torch.Tensor], rows: int, form: str) -> float:
    xs = {k: torch.randn(rows, k, dtype=weights[0].dtype) for k in (576, 1536)}
    if form == "linear":
        def run():
            return [F.linear(xs[w.shape[1]], w) for w in weights]
    elif form == "packed":
        packed = [(w, packed_gemm.prepack(w)) for w in weights]

        def run():  # oneDNN itself: packed_gemm.packed_linear takes W-left at two rows
            return [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "") for w, p in packed]
    else:
        def run():
            return [torch.mm(w, xs[w.shape[1]].t()) for w in weights]
    for _ in range(2):
        run()
    t0 = time.perf_counter()
    for _ in range(5):
        run()
    return (time.perf_counter() - t0) / 5 * 1000


def dispatch(rounds: int = 7, calls: int = 2000) -> None:
    """Per-call time of one small packed GEMM (9 rows, a 64 x 576 weight, so the call dominates): oneDNN called
    directly, through the engine's op (a Library definition, as Inductor calls it), and through the same kernel
    registered with @torch.library.custom_op (how the op was defined before)."""
    from torch.library import custom_op

    @custom_op("lora_bench::packed_linear", mutates_args=())
    def via_custom_op(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        return packed_gemm._packed_linear(x, weight, packed)

    weight = torch.randn(64, 576)
    packed, x = packed_gemm.prepack(weight), torch.randn(9, 576)
    forms = {
        "oneDNN directly": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        "engine op (Library)": lambda: torch.ops.lora_compile.packed_linear.default(x, weight, packed),
        "@custom_op": lambda: torch.ops.lora_bench.packed_linear.default(x, weight, packed),
    }
    us = interleaved({name: per_call_us(fn, calls) for name, fn in forms.items()}, rounds)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; us per call, 9 rows x 64 x 576")
    for name, value in us.items():
        print(f"  {name:22s} {value:7.1f}")


def bandwidth(rounds: int = 5) -> None:
    """Read speed from memory: a sum over 1 GiB of float32 (far beyond any cache), the best of `rounds`. A decode step
    reads every weight once, so bytes / this speed is its floor (SmolLM2-135M: 0.54 GB float32, 0.27 GB bf16)."""
    data = torch.ones(256 * 1024 * 1024)
    data.sum()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - t0)
    gb = data.numel() * data.element_size() / 1e9
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; read {gb:.2f} GB in {best * 1e3:.1f} ms: "
          f"{gb / best:.1f} GB/s")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dispatch", action="store_true", help="per-call cost of the packed GEMM op instead")
    p.add_argument("--prefill", action="store_true", help="prefill-sized row counts (65-513) instead")
    p.add_argument("--bandwidth", action="store_true", help="the machine's memory read speed instead")
    p.add_argument("--rows", type=int, nargs="+",
                   help="these row counts only (default: decode's 1-128, or --prefill's)")
    args = p.parse_args()
    if args.dispatch:
        return dispatch()
    if args.bandwidth:
        return bandwidth()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms for all GEMMs of one step")
    names = ["fp32 F.linear", "fp32 W-left", "fp32 packed", "bf16 F.linear", "bf16 W-left"]
    fp32 = [torch.randn(*s) for s in SHAPES]
    bf16 = [w.bfloat16() for w in fp32]
    runs = [(fp32, "linear"), (fp32, "left"), (fp32, "packed"), (bf16, "linear"), (bf16, "left")]
    if packed_gemm.native_bf16():  # the engine packs bf16 weights only where the CPU computes bf16
        names.append("bf16 packed")
        runs.append((bf16, "packed"))
    print(f"{'rows':>5} " + " ".join(f"{n:>14}" for n in names))
    for rows in args.rows or ((65, 128, 192, 256, 384, 513) if args.prefill else (1, 2, 3, 4, 5, 6, 8, 9, 16, 33, 128)):
        cells = [step_ms(ws, rows, form) for ws, form in runs]
        print(f"{rows:>5} " + " ".join(f"{c:>14.1f}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
