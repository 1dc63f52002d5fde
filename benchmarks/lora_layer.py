"""Why LoRA is computed per token by index: one decoder layer's LoRA work, compiled, in the form the engine
uses and in the GEMM forms it replaced, at decode and at prefill sizes.

    python -m benchmarks.lora_layer [--tokens 9 257] [--rounds 7] [--calls N] [--no-compile]
    python -m benchmarks.lora_layer --engine [--batch 32]   # the engine's step: adapters grouped vs interleaved
    python -m benchmarks.lora_layer --dtype bfloat16 --copies 30 --tokens 9 33 --forms "8 adapters"
    python -m benchmarks.lora_layer --engine-b-layout --tokens 8 32 --rounds 8 [--dtype bfloat16]   # (batches)

--copies N: N layers of distinct weights called in turn, so that every weight comes from memory as in a 30-layer
step (one copy stays in the caches from call to call); --forms: only the forms whose names contain one of these.

SmolLM2-135M's shapes (qkv 576 -> 576+192+192, o 576 -> 576, gate_up 576 -> 2x1536, down 1536 -> 576), rank 16,
8 adapter slots plus the zero slot, float32, packed base GEMMs. Forms:
- indexed (lora_compile.model.layers): each token reads its own slot's A and B inside two reductions, fused by Inductor;
- indexed, B out-major: the same with B stored as (out, slot, rank), the layout used before (a rank-long reduction
  with a horizontal sum per output, instead of one vectorised over outputs);
- masked GEMMs, one slot: the previous one-adapter path (a shrink GEMM, one expand GEMM per fused slice);
- masked GEMMs, all slots: the previous several-adapter path (shrink and expand over every slot, oneDNN-packed,
  each token's other slots masked to zero);
- indexed, grouped order: the engine's form on the same mix with each adapter's tokens adjacent (as Engine._plan
  lays out a step), so a slot's weights come from memory once and then from cache;
- LoRA alone: the indexed LoRA delta without the base GEMMs between layers, so the adapters' weights stay in cache
  from call to call: what the LoRA arithmetic costs, against what it costs where the base weights evict them;
- shrink in the base GEMM: every slot's A appended to the base weight's rows, one packed GEMM for the base output
  and all slots' shrinks, each token's own kept by index, then the indexed expand (bfloat16 on AMX is where the
  extra rows might cost nothing);
- B chunk-major: the indexed form with B stored (slot, out / 32, rank, 32) and the expand's output laid out by
  32-wide chunk, so that each token reads its B as contiguous 1 KiB blocks rather than rank rows `out` apart (the
  engine's CPU form in bfloat16, LoRALinear.b_chunk; "indexed" above is float32's).
Prints microseconds per layer and the LoRA part (minus the base GEMMs alone), medians of interleaved rounds.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from lora_compile import compile_policy
from lora_compile.model import lora_deltas
from lora_compile.model.layers import LoRALinear
from lora_compile.model.packed_gemm import packed_linear, plain_linear, prepack

SHAPES = [(576, (576, 192, 192)), (576, (576,)), (576, (1536, 1536)), (1536, (576,))]
RANK, SLOTS = 16, 8


CHUNK = compile_policy.LORA_B_CHUNK


def make_layers(dtype: torch.dtype = torch.float32, copies: int = 1) -> list[LoRALinear]:
    torch.manual_seed(0)
    layers = []
    for in_features, outs in SHAPES * copies:
        layer = LoRALinear(in_features, outs, False, SLOTS, RANK, dtype, torch.device("cpu"))
        layer.weight.normal_(std=in_features ** -0.5)
        # The same adapters with B chunk-major (LoRALinear.b_chunk), loaded the way the engine loads them.
        layer.chunk_major = LoRALinear(in_features, outs, False, SLOTS, RANK, dtype, torch.device("cpu"),
                                       b_chunk=CHUNK)
        for slot in range(1, SLOTS + 1):
            parts = [(torch.randn(RANK, in_features) * 0.05, torch.randn(o, RANK) * 0.05) for o in outs]
            layer.load_slot(slot, parts)
            layer.chunk_major.load_slot(slot, parts)
        layer.prepack()
        # What the masked all-slots form kept: every slot's A, and per slice every slot's B, oneDNN-packed.
        layer.a_all = layer.lora_a_stack[1:].reshape(SLOTS * layer.slot_rows, in_features).contiguous()
        layer.a_all_packed = prepack(layer.a_all)
        layer.b_all = [layer.lora_b[1:, :, s:e].permute(2, 0, 1).reshape(e - s, SLOTS * RANK).contiguous()
                       for s, e in layer._slices]
        # The layout the indexed form used before: B as (out, slot, rank), rank innermost.
        layer.b_out_major = layer.lora_b.permute(2, 0, 1).contiguous()
        layer.b_all_packed = [prepack(b) for b in layer.b_all]
        layer.w_and_a = torch.cat([layer.weight, layer.a_all]).contiguous()
        layer.w_and_a_packed = prepack(layer.w_and_a)
        layers.append(layer)
    return layers


def base(layer, x):
    return packed_linear(x, layer.weight, layer.weight_packed)


def indexed(layer, x, w, mask):
    return base(layer, x) + lora_deltas.indexed(layer, x, w)


def indexed_out_major(layer, x, w, mask):  # the indexed form on B as (out, slot, rank): a reduction per output
    t, c = x.shape[0], len(layer.output_sizes)
    shrink = (x[:, None, :] * layer.lora_a_stack[w]).sum(-1).view(t, c, RANK)
    deltas = [(shrink[:, None, i, :] * layer.b_out_major[s:e].permute(1, 0, 2)[w]).sum(-1)
              for i, (s, e) in enumerate(layer._slices)]
    return base(layer, x) + (deltas[0] if c == 1 else torch.cat(deltas, -1))


def shrink_in_base_gemm(layer, x, w, mask):
    t, c, out = x.shape[0], len(layer.output_sizes), layer.out_features
    y = packed_linear(x, layer.w_and_a, layer.w_and_a_packed)
    shrinks = y[:, out:].view(t, SLOTS, c, RANK)
    own = torch.where((w > 0)[:, None, None], shrinks[torch.arange(t), (w - 1).clamp(min=0)], 0)  # slot 0: zeros
    b = layer.lora_b[w]
    deltas = [(own[:, i, :, None] * b[:, :, s:e]).sum(1) for i, (s, e) in enumerate(layer._slices)]
    return y[:, :out] + (deltas[0] if c == 1 else torch.cat(deltas, -1))


def b_chunk_major(layer, x, w, mask):  # the engine's CPU form in bfloat16 (LoRALinear.b_chunk)
    return base(layer, x) + lora_deltas.indexed(layer.chunk_major, x, w)


def lora_alone(layer, x, w, mask):  # the LoRA delta only: no base GEMM streams its weights through the caches
    return lora_deltas.indexed(layer, x, w)


def masked_one_slot(layer, x, w, mask):  # mask: (T, 1), slot 1
    t, c = x.shape[0], len(layer.output_sizes)
    h = plain_linear(x, layer.lora_a(1)).reshape(t, c, RANK) * mask.view(t, 1, 1)
    deltas = [h[:, i] @ layer.lora_b[1, :, s:e] for i, (s, e) in enumerate(layer._slices)]
    return base(layer, x) + (deltas[0] if c == 1 else torch.cat(deltas, -1))


def masked_all_slots(layer, x, w, mask):  # mask: (T, SLOTS)
    t, c = x.shape[0], len(layer.output_sizes)
    h = packed_linear(x, layer.a_all, layer.a_all_packed).view(t, SLOTS, c, RANK) * mask.view(t, SLOTS, 1, 1)
    deltas = [packed_linear(h[:, :, i].reshape(t, SLOTS * RANK), layer.b_all[i], layer.b_all_packed[i])
              for i in range(c)]
    return base(layer, x) + (deltas[0] if c == 1 else torch.cat(deltas, -1))


def compiled_form(layers, form, compile: bool = True):
    """`form` over every layer in one compiled call (compile false: the same call, eager)."""
    def run(x576, x1536, w, mask):
        return [form(layer, x1536 if layer.in_features == 1536 else x576, w, mask) for layer in layers]
    return torch.compile(run, fullgraph=True, dynamic=False) if compile else run


def measure(tokens: int, rounds: int, layers, chosen: list[str] | None = None, compile: bool = True,
            calls: int | None = None) -> None:
    torch._dynamo.reset()  # every form at every size is a graph of its own: do not run into the recompile limit
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)  # one `run`, 10 forms
    dtype = layers[0].weight.dtype
    x576, x1536 = torch.randn(tokens, 576, dtype=dtype), torch.randn(tokens, 1536, dtype=dtype)
    one = torch.tensor([1] * (tokens - 1) + [0])                           # every token on slot 1, one padding
    mixed = torch.tensor([1 + t % SLOTS for t in range(tokens - 1)] + [0])  # 8 adapters; slot 0: zero rows
    grouped = torch.cat([mixed[:-1].sort().values, mixed[-1:]])  # the same mix, each adapter's tokens adjacent
    mask_one = (one == 1).to(dtype)[:, None]
    mask_mixed = F.one_hot(mixed, SLOTS + 1)[:, 1:].to(dtype)

    def compiled(form):  # (compile false, --no-compile: the same forms run eagerly)
        return compiled_form(layers, form, compile)

    forms = {
        "base GEMMs alone": (compiled(lambda l, x, w, m: base(l, x)), one, mask_one),
        "1 adapter, indexed": (compiled(indexed), one, mask_one),
        "1 adapter, indexed, B out-major": (compiled(indexed_out_major), one, mask_one),
        "1 adapter, masked GEMMs": (compiled(masked_one_slot), one, mask_one),
        "8 adapters, indexed": (compiled(indexed), mixed, mask_mixed),
        "8 adapters, indexed, B out-major": (compiled(indexed_out_major), mixed, mask_mixed),
        "8 adapters, masked GEMMs": (compiled(masked_all_slots), mixed, mask_mixed),
        "8 adapters, indexed, grouped order": (compiled(indexed), grouped, mask_mixed),
        "1 adapter, LoRA alone": (compiled(lora_alone), one, mask_one),
        "8 adapters, LoRA alone": (compiled(lora_alone), mixed, mask_mixed),
        "8 adapters, shrink in the base GEMM, grouped order": (compiled(shrink_in_base_gemm), grouped, mask_mixed),
        "8 adapters, B chunk-major, grouped order": (compiled(b_chunk_major), grouped, mask_mixed),
    }
    forms = {name: form for name, form in forms.items()
             if name == "base GEMMs alone" or not chosen or any(c in name for c in chosen)}
    # The forms agree (the masked ones are what the engine computed before).
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for a, b in (("1 adapter, indexed", "1 adapter, masked GEMMs"), ("8 adapters, indexed", "8 adapters, masked GEMMs"),
                 ("1 adapter, indexed", "1 adapter, indexed, B out-major"),
                 ("8 adapters, indexed", "8 adapters, indexed, B out-major"),
                 ("8 adapters, indexed, grouped order", "8 adapters, shrink in the base GEMM, grouped order"),
                 ("8 adapters, indexed, grouped order", "8 adapters, B chunk-major, grouped order")):
        if a not in forms or b not in forms:
            continue
        fa, wa, ma = forms[a]
        fb, wb, mb = forms[b]
        for ya, yb in zip(fa(x576, x1536, wa, ma), fb(x576, x1536, wb, mb)):
            torch.testing.assert_close(ya, yb, atol=tol, rtol=tol)
    calls = calls or max(5, 2700 // tokens // len(layers) * len(SHAPES))
    samples: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(rounds):
        for name, (fn, w, mask) in forms.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(x576, x1536, w, mask)
            samples[name].append((time.perf_counter() - t0) / calls * 1e6)
    copies = len(layers) // len(SHAPES)
    base_us = statistics.median(samples["base GEMMs alone"]) / copies
    print(f"\n{tokens} tokens, {dtype}, {copies} layer cop{'y' if copies == 1 else 'ies'}: us per layer (LoRA part = "
          "minus the base GEMMs alone)")
    for name, values in samples.items():
        us = statistics.median(values) / copies
        part = us if name.endswith("LoRA alone") else us - base_us  # nothing of the base to take off
        print(f"  {name:52s} {us:8.1f}   LoRA part {part:7.1f}")


def engine_order(batch: int, rounds: int) -> None:
    """Decode step time of the engine (float32, compiled) with 8 adapters, sequences assigned round-robin: as the
    engine plans a step (each adapter's tokens adjacent) against the same plan left in sequence order."""
    import tempfile
    from pathlib import Path

    from benchmarks.common import (
        decode_step_time,
        register_adapters,
        smollm2_checkpoint,
        write_lora_adapters,
    )
    from lora_compile import Engine, EngineConfig

    model = smollm2_checkpoint()
    names = [f"a{i}" for i in range(SLOTS)]
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(EngineConfig(model=str(model), dtype="float32", max_batch_size=batch, max_seq_len=512,
                                     max_loras_per_batch=SLOTS, max_num_batched_tokens=max(256, 16 * batch + 1)))
        register_adapters(engine, write_lora_adapters(model, Path(tmp), names, rank=RANK))
        engine.warmup()
        planned = engine._plan

        def in_sequence_order(seqs):
            single, chunks = planned(seqs)
            order = {id(s): i for i, s in enumerate(seqs)}
            return sorted(single, key=lambda p: order[id(p.seq)]), chunks

        samples: dict[str, list[float]] = {"grouped (engine)": [], "interleaved": []}
        for _ in range(rounds):
            for name, plan in (("grouped (engine)", planned), ("interleaved", in_sequence_order)):
                engine._plan = plan
                samples[name].append(decode_step_time(engine, batch, names, steps=16, prompt_len=16)[0] * 1e3)
    print(f"batch {batch}, {SLOTS} adapters round-robin, float32: ms per decode step (median of {rounds} rounds)")
    for name, values in samples.items():
        print(f"  {name:18s} {statistics.median(values):7.2f}")
    ratios = [a / b for a, b in zip(samples["interleaved"], samples["grouped (engine)"])]
    print(f"  interleaved / grouped per round: {' '.join(f'{r:.3f}' for r in ratios)}")


def engine_b_layout(batches: list[int], rounds: int, dtype: str) -> None:
    """Decode step time with 8 adapters of two engines in one process, B stored chunk-major (the CPU's bfloat16
    form, compile_policy.lora_b_chunk) and as rank rows (float32's), steps alternating engine by engine: a
    difference of a few percent is below the drift between processes on a shared machine."""
    import tempfile
    from pathlib import Path

    from benchmarks.common import decode_step_time, register_adapters, smollm2_checkpoint, write_lora_adapters
    from lora_compile import Engine, EngineConfig
    from service.runner import engine_thread

    model = smollm2_checkpoint()
    names = [f"a{i}" for i in range(SLOTS)]
    chosen = compile_policy.lora_b_chunk

    def build(chunked: bool) -> Engine:
        compile_policy.lora_b_chunk = lambda *_: compile_policy.LORA_B_CHUNK if chunked else 0  # any dtype
        try:
            engine = Engine(EngineConfig(model=str(model), dtype=dtype, max_num_seqs=max(batches), max_seq_len=160,
                                         max_num_batched_tokens=512, max_loras_per_batch=SLOTS, max_lora_rank=RANK))
        finally:
            compile_policy.lora_b_chunk = chosen
        register_adapters(engine, adapters)
        engine.warmup()
        return engine

    with tempfile.TemporaryDirectory() as tmp:
        adapters = write_lora_adapters(model, Path(tmp), names, rank=RANK)
        engines = {"rank rows": engine_thread.call(build, False), "chunk-major": engine_thread.call(build, True)}
        for batch in batches:
            ms: dict[str, list[float]] = {name: [] for name in engines}
            for r in range(rounds):
                for name, engine in (list(engines.items()) if r % 2 == 0 else list(engines.items())[::-1]):
                    ms[name].append(engine_thread.call(decode_step_time, engine, batch, names, 16, 48)[0] * 1e3)
            ratios = [c / w for c, w in zip(ms["chunk-major"], ms["rank rows"])]
            print(f"batch {batch}, 8 adapters, {dtype}: ms a decode step, rank rows "
                  f"{statistics.median(ms['rank rows']):.2f}, chunk-major {statistics.median(ms['chunk-major']):.2f}; "
                  f"chunk-major / rank rows per round {' '.join(f'{x:.3f}' for x in ratios)} "
                  f"(median {statistics.median(ratios):.3f})", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[9, 257], help="rows (a decode step of batch B: B + 1)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--engine", action="store_true", help="the engine's step, adapters grouped vs interleaved")
    p.add_argument("--batch", type=int, default=32, help="with --engine")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--copies", type=int, default=1, help="layers of distinct weights, called in turn")
    p.add_argument("--forms", nargs="+", help="only the forms whose names contain one of these")
    p.add_argument("--engine-b-layout", action="store_true", help="two engines' steps: B chunk-major vs rank rows")
    p.add_argument("--no-compile", action="store_true",
                   help="the layer forms eagerly (a check that they run: Inductor's fusion is what is measured)")
    p.add_argument("--calls", type=int, help="calls of each form per round (default: ~2700 token-layers' worth)")
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.engine_b_layout:
        engine_b_layout(args.tokens, args.rounds, args.dtype)
        return
    if args.engine:
        engine_order(args.batch, args.rounds)
        return
    layers = make_layers(getattr(torch, args.dtype), args.copies)
    with torch.no_grad():
        for tokens in args.tokens:
            measure(tokens, args.rounds, layers, args.forms, not args.no_compile, args.calls)


if __name__ == "__main__":
    main()
