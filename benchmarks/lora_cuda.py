"""The LoRA kernels on a GPU, one decoder layer's four projections at a time: what each form (EngineConfig.lora_kernel)
adds to the base GEMMs, at decode and prefill token counts, one adapter and 8 distinct ones.

    python -m benchmarks.lora_cuda [--tokens 8 32 64 512] [--kernels masked triton] [--layers 4] [--replays 200]

The Llama-3.2-1B projections (qkv 2048 -> 2048+512+512, o 2048 -> 2048, gate_up 2048 -> 2x8192, down 8192 -> 2048),
bfloat16, rank 16, 8 slots plus the zero slot, --layers copies with their own weights called in turn (so that the
base weights stream from memory as in a step, and evict the adapters' from the L2 between layers). Each form is
compiled (one graph, the token count dynamic) and recorded in a CUDA graph per token count and mix; replays are
timed with CUDA events. The step's own derivation of the LoRA metadata (LoRABatch.derive) runs once, outside the
timed graph, as the engine runs it once a step for every layer. Prints microseconds per layer and each form's
ratio to the base GEMMs alone; checks that every form computes what the masked one does.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.common import fmt_row
from lora_compile import compile_policy
from lora_compile.forward_batch import LoRABatch
from lora_compile.layers import LoRALinear

SHAPES = {"qkv": (2048, (2048, 512, 512)), "o": (2048, (2048,)), "gate_up": (2048, (8192, 8192)), "down": (8192, (2048,))}
RANK, SLOTS = 16, 8
MIXES = {"1 adapter": lambda t: torch.ones(t, dtype=torch.int64), "8 adapters": lambda t: torch.arange(t) * SLOTS // t + 1}


def make_layer(kernel: str, seed: int) -> dict[str, LoRALinear]:
    gen = torch.Generator().manual_seed(seed)
    layer = {}
    for name, (n_in, outs) in SHAPES.items():
        proj = LoRALinear(n_in, outs, False, SLOTS, RANK, torch.bfloat16, torch.device("cuda"),
                          block_diagonal_b=kernel in compile_policy.GEMM_KERNELS, triton=kernel == "triton")
        proj.weight.copy_(torch.randn(proj.weight.shape, generator=gen) * n_in ** -0.5)
        for slot in range(1, SLOTS + 1):
            proj.load_slot(slot, [(torch.randn(RANK, n_in, generator=gen) * n_in ** -0.5,
                                   torch.randn(o, RANK, generator=gen) * 0.05) for o in outs])
        layer[name] = proj
    return layer


def layer_forward(layer: dict[str, LoRALinear], x: torch.Tensor, lora: LoRABatch) -> torch.Tensor:
    """The four projections in a decoder layer's order (attention's output stands in for itself: x again)."""
    qkv = layer["qkv"](x, lora, True)
    h = layer["o"](x + qkv[:, :2048], lora, True)
    gate, up = layer["gate_up"](h, lora, True).chunk(2, dim=-1)
    return h + layer["down"](F.silu(gate) * up, lora, True)


def stack(layers, x: torch.Tensor, *flat: torch.Tensor | None) -> torch.Tensor:
    lora = LoRABatch(*flat)
    for layer in layers:
        x = layer_forward(layer, x, lora)
    return x


def time_graph(fn, replays: int) -> float:
    """Microseconds per replay of fn recorded in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiles and autotunes outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / replays


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[8, 32, 64, 512])
    p.add_argument("--kernels", nargs="+", default=["masked", "triton"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--replays", type=int, default=200)
    args = p.parse_args()
    assert torch.cuda.is_available(), "benchmarks.lora_cuda needs a CUDA GPU"
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    compile_policy.configure(None)
    models = {k: [make_layer(k, seed) for seed in range(args.layers)] for k in args.kernels}
    compiled = torch.compile(stack, fullgraph=True)
    results: dict[tuple, float] = {}
    with torch.inference_mode():
        for tokens in args.tokens:
            x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
            torch._dynamo.mark_dynamic(x, 0)
            base_layers = models[args.kernels[0]]
            results[(tokens, "base")] = time_graph(lambda: compiled(base_layers, x, None), args.replays)
            for mix, slots in MIXES.items():
                idx = slots(tokens).cuda()
                outputs = {}
                for kernel in args.kernels:
                    flat = vars(LoRABatch(idx).derive(kernel, SLOTS + 1)).values() if kernel != "indexed" else [idx]
                    flat = list(flat)
                    for t in flat:
                        if t is not None and t.dim() and t.shape[0] == tokens:
                            torch._dynamo.mark_dynamic(t, 0)
                    fn = (lambda layers=models[kernel], flat=flat: compiled(layers, x, *flat))
                    results[(tokens, mix, kernel)] = time_graph(fn, args.replays)
                    outputs[kernel] = fn().float()
                first = outputs[args.kernels[0]]
                for kernel, out in outputs.items():
                    err = (out - first).abs().max().item() / first.abs().max().item()
                    print(f"T={tokens} {mix}: {kernel} vs {args.kernels[0]}: max difference {err:.2e} of the largest",
                          flush=True)
    widths = (7, 11, 9, *(16,) * len(args.kernels))
    print("\nmicroseconds per layer (4 projections), base GEMMs alone and with each LoRA form (ratio base / form)")
    print(fmt_row(("tokens", "mix", "base", *args.kernels), widths))
    for tokens in args.tokens:
        base = results[(tokens, "base")]
        for mix in MIXES:
            cells = [f"{results[(tokens, mix, k)]:.1f} ({base / results[(tokens, mix, k)]:.2f}x)" for k in args.kernels]
            print(fmt_row((tokens, mix, f"{base:.1f}", *cells), widths))


if __name__ == "__main__":
    main()
