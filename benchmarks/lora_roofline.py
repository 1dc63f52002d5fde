"""How close the CPU's LoRA kernels come to the machine's limits: the one-command check of what an 8-adapter decode
step's LoRA work costs on this CPU, and why (issue 34).

    python -m benchmarks.lora_roofline [--tokens 9 33] [--dtypes float32 bfloat16] [--copies 4] [--rounds 5]
                                       [--no-compile]

Prints, per dtype:
- stream: the read bandwidth of code Inductor generates on this machine (a row sum over 600 MB), the most any
  memory-bound kernel of ours can read;
- per token count (a decode step of batch B runs B + 1 tokens), the engine's compiled LoRA delta
  (lora_compile.model.lora_deltas.indexed, B laid out as compile_policy.lora_b_chunk chooses) over --copies times
  30 layers of SmolLM2-135M's projections with 8 adapters of rank 16 mixed over the tokens, adapters' tokens
  adjacent as the engine lays out a step. Its weights exceed the caches, so they come from memory, as in a step.
  Shown: ms per 30 layers (one step's LoRA work), GB/s of adapter weights read and its share of the stream figure,
  and GMAC/s of LoRA arithmetic (each token through its own adapter); "at stream" is what the same bytes would cost
  at the stream bandwidth.

Near the stream figure, the adapters' bytes bound the step; well below it while GMAC/s grows with the tokens, the
generated reductions' arithmetic does (docs/benchmarks.md). Compare the ms with `python -m benchmarks.step_profile`'s
base and 8-adapter rows to see LoRA's share of a whole step.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks import cpu_report
from benchmarks.common import interleaved, per_call_us
from benchmarks.lora_layer import RANK, SHAPES, SLOTS
from lora_compile import compile_policy
from lora_compile.model import lora_deltas
from lora_compile.model.layers import LoRALinear
from service import allocator

LAYERS = 30  # SmolLM2-135M's decoder layers: one step's LoRA work
STREAM_BYTES = 600 * 2**20


def stream_gbs(dtype: torch.dtype, rounds: int, compile: bool = True) -> float:
    """GB/s of the best of `rounds` reads by Inductor's code in `dtype`: what our generated kernels can read
    (`python -m benchmarks.gemm --bandwidth` times ATen's float32 sum; ATen's bfloat16 sum reads several times
    slower, so it cannot stand for a bfloat16 kernel)."""
    rows = torch.randn(STREAM_BYTES // (4096 * dtype.itemsize), 4096).to(dtype)
    row_sum = torch.compile(lambda t: t.float().sum(-1)) if compile else (lambda t: t.float().sum(-1))
    row_sum(rows)  # compiled on the first call
    read = per_call_us(lambda: row_sum(rows), 1)
    return rows.nbytes / min(read() for _ in range(rounds)) / 1e3


def make_projections(dtype: torch.dtype, copies: int) -> list[LoRALinear]:
    """copies x 30 layers' four projections, every slot holding an adapter (slot 0, the base model's, zeros)."""
    torch.manual_seed(0)
    layers = []
    for _ in range(copies * LAYERS):
        for in_features, outs in SHAPES:
            chunk = compile_policy.lora_b_chunk("indexed", torch.device("cpu"), dtype, outs)
            layer = LoRALinear(in_features, outs, False, SLOTS, RANK, dtype, torch.device("cpu"), b_chunk=chunk)
            for slot in range(1, SLOTS + 1):
                layer.load_slot(slot, [(torch.randn(RANK, in_features) * 0.05, torch.randn(o, RANK) * 0.05)
                                       for o in outs])
            layers.append(layer)
    return layers


def lora_delta_fn(layers: list[LoRALinear], compile: bool = True):
    """One compiled call over every layer, as the step makes it: the delta a nested region, traced once per
    projection shape (the key) and called for every layer."""
    region = torch.compiler.nested_compile_region(
        lambda layer, x, w: lora_deltas.indexed(layer, x, w),
        reuse_hash_fn=lambda layer, *_: SHAPES.index((layer.in_features, layer.output_sizes)))
    if not compile:
        return lambda xs, w: [lora_deltas.indexed(layer, xs[layer.in_features], w) for layer in layers]
    return torch.compile(lambda xs, w: [region(layer, xs[layer.in_features], w) for layer in layers])


def measure(dtype: torch.dtype, tokens_list: list[int], copies: int, rounds: int, compile: bool = True) -> None:
    stream = stream_gbs(dtype, rounds, compile)
    name = str(dtype).removeprefix("torch.")
    print(f"{name}: stream (Inductor row sum over {STREAM_BYTES >> 20} MiB) {stream:.1f} GB/s", flush=True)
    layers = make_projections(dtype, copies)
    bytes_per_step = sum(layer.lora_a_stack[1:].nbytes + layer.lora_b[1:].nbytes for layer in layers) // copies
    macs_per_token = bytes_per_step // dtype.itemsize // SLOTS  # each token through its own adapter's A and B
    run = lora_delta_fn(layers, compile)
    for tokens in tokens_list:
        xs = {n: torch.randn(tokens, n).to(dtype) for n in {i for i, _ in SHAPES}}
        w = (torch.arange(tokens) % SLOTS + 1).sort().values  # every adapter, its tokens adjacent
        for t in (w, *xs.values()):
            torch._dynamo.mark_dynamic(t, 0)
        run(xs, w)  # compiled on the first call
        s = interleaved({"delta": per_call_us(lambda: run(xs, w), 1)}, rounds)["delta"] / 1e6 / copies
        gbs = bytes_per_step / s / 1e9
        print(f"  {tokens:3d} tokens: LoRA delta {1e3 * s:6.2f} ms per {LAYERS} layers, {gbs:5.1f} GB/s "
              f"({100 * gbs / stream:3.0f} % of stream; at stream {1e3 * bytes_per_step / stream / 1e9:.2f} ms), "
              f"{tokens * macs_per_token / s / 1e9:5.1f} GMAC/s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[9, 33])
    p.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    p.add_argument("--copies", type=int, default=4, help="steps' worth of distinct adapter weights, called in turn")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-compile", action="store_true",
                   help="eager reads and deltas (a check that it runs: Inductor's code is what is measured)")
    args = p.parse_args()
    allocator.reexec_with_tcmalloc()  # measure what lora-serve runs on (LORA_SERVE_ALLOCATOR=system: glibc's)
    print(cpu_report.describe(torch.get_num_threads()))
    compile_policy.configure(None)
    with torch.no_grad():
        for dtype in args.dtypes:
            measure(getattr(torch, dtype), args.tokens, args.copies, args.rounds, not args.no_compile)


if __name__ == "__main__":
    main()
