"""Why the layer stack is one compiled frame: the engine as it compiles (the stack, with the decoder layer as a
nested compile region, saved and loaded ahead of time) against the same stack left to torch.compile at start
(`precompile=False`: Dynamo's guards run every step) and the scheme it replaced (each decoder layer its own
compiled frame), side by side.

    python -m benchmarks.compile_scope [--batches 8 32] [--rounds 5] [--model-size tiny]

Both engines live in this one process and are measured in turn (A B A B ...). Rank-16 adapters on all seven
projections of the SmolLM2-135M-shaped random checkpoint; decode step time in ms for the base model, one adapter
and 8 distinct adapters, and ratios (stack / traced, stack / per layer: below 1 means the saved stack is faster).
"""
from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import torch

from benchmarks.common import (
    decode_step_time,
    fmt_row,
    add_model_size,
    interleaved,
    register_adapters,
    sized_checkpoint,
    write_lora_adapters,
)
from lora_compile import Engine, EngineConfig, compile_policy

N_ADAPTERS = 8


# Set while the per-layer frames run: a frame of its own per layer cannot take the torch.cond that skips the
# placeholder prefill group over the KV pools it writes (compile_policy.skip_placeholder_prefill), so those frames
# trace without it, as the engine did when it compiled layer by layer; the stack's frames keep the engine's choice.
_IN_LAYER_FRAMES = [False]
_skip_placeholder_prefill = compile_policy.skip_placeholder_prefill


def _skip_unless_in_layer_frames(device: torch.device) -> bool:
    return _skip_placeholder_prefill(device) and not _IN_LAYER_FRAMES[0]


def compile_each_layer(model) -> None:
    """The scheme the engine's one compiled stack replaced: each decoder layer its own compiled frame, called from
    Python once per layer, taking the metadata views as they are."""
    compile_policy.skip_placeholder_prefill = _skip_unless_in_layer_frames

    def each_layer(h, fb):
        compile_policy.mark_dynamic(h, fb)
        fb = dataclasses.replace(fb, compiled=True)  # the layers' compiled kernels (indexed LoRA, decode reductions)
        _IN_LAYER_FRAMES[0] = True
        try:
            for layer in model.layers:
                h = layer(h, fb)
        finally:
            _IN_LAYER_FRAMES[0] = False
        return h

    model._run_layers = each_layer
    for layer in model.layers:
        layer.compile(fullgraph=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=5)
    add_model_size(p)
    args = p.parse_args()
    model = sized_checkpoint(args.model_size)
    names = [f"a{i}" for i in range(N_ADAPTERS)]
    with tempfile.TemporaryDirectory() as tmp:
        adapters = write_lora_adapters(model, Path(tmp), names)
        limits = dict(model=str(model), max_batch_size=max(args.batches), max_seq_len=256,
                      max_num_batched_tokens=512, max_loras_per_batch=N_ADAPTERS, max_lora_rank=16,
                      merge_lone_adapter="off")  # compares compile schemes on per-token LoRA
        stack = Engine(EngineConfig(**limits))
        traced = Engine(EngineConfig(**limits, precompile=False))
        per_layer = Engine(EngineConfig(**limits))
        compile_each_layer(per_layer.model)
        engines = {"stack": stack, "traced": traced, "per layer": per_layer}
        for engine in engines.values():
            register_adapters(engine, adapters)
            engine.warmup()
        mixes = {"base": [None], "one adapter": names[:1], f"{N_ADAPTERS} adapters": names}
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; decode step ms")
        widths = (6, 14, 10, 10, 12, 14, 16)
        print(fmt_row(("batch", "mix", "stack", "traced", "per layer", "stack/traced", "stack/per layer"), widths))
        for b in args.batches:
            measures = {}
            for mix, adapters in mixes.items():
                for kind, engine in engines.items():
                    measures[(mix, kind)] = lambda e=engine, a=adapters: decode_step_time(e, b, a, args.steps)[0]
            t = interleaved(measures, args.rounds)
            for mix in mixes:
                s, tr, l = t[(mix, "stack")], t[(mix, "traced")], t[(mix, "per layer")]
                print(fmt_row((b, mix, f"{s * 1e3:.2f}", f"{tr * 1e3:.2f}", f"{l * 1e3:.2f}", f"{s / tr:.3f}",
                               f"{s / l:.3f}"), widths), flush=True)


if __name__ == "__main__":
    main()
