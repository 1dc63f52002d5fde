"""Puts the compiled layer stack on a model, in the form compile_policy decides: one compiled frame (saved and
loaded by precompile, or traced at every start), or before torch 2.12 a compiled frame per decoder layer; and, where
a quantized head can take Inductor's AMX template, the head's product of many rows as a small frame (compile_head).
Kept apart from compile_policy, which decides and imports no model code, so that the model reads its decisions
without an import cycle."""
from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import compile_policy
from ..model.causal_lm import decoder_layer, layer_by_layer, layer_stack
from ..model.forward_batch import ForwardBatch
from ..model.quantization import amx_tiles
from . import precompile

log = logging.getLogger(__name__)


def compile_model(model, cache_dir: Path, precompiled: bool = True) -> None:
    """Compile the model's layer stack (model.layer_stack) as one frame: saved in and loaded from `cache_dir` (what
    configure returned) with its traced frame when `precompiled` (precompile.PrecompiledStack), else traced by
    torch.compile at every start. Before torch 2.12, each decoder layer is a compiled frame of its own instead
    (compile_each_layer)."""
    compile_head(model)
    if not compile_policy.REUSE_HASH:
        log.info("torch %s: each decoder layer is compiled as a frame of its own (the one-frame stack and saved "
                 "stacks need torch >= 2.12)", torch.__version__)
        compile_each_layer(model)
        return
    if precompiled:
        model._run_layers = precompile.PrecompiledStack(model, layer_stack, compile_policy.mark_dynamic,
                                                        precompile.stacks_directory(cache_dir), _options(model))
    else:
        compiled = torch.compile(layer_stack, fullgraph=True, options=_options(model))

        def traced(h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
            compile_policy.mark_dynamic(h, fb)
            return compiled(model, h, *fb.flat())

        model._run_layers = traced


def _options(model) -> dict:
    return compile_policy.inductor_options(model.norm.weight.device, model.weight_forms)


def compile_head(model) -> None:
    """Where the quantized head can take Inductor's AMX template (model.head_tiles_usable), its product for more
    than model.head_tiles_above() rows as a small compiled frame of its own (the head runs after the layer stack,
    outside it), rows dynamic, one padding row added (a lone row would be a size-1 specialisation); traced here, at
    start, rather than in the first large step. Fewer rows keep torch's kernel."""
    if not model.head_tiles_usable():
        return
    compiled = torch.compile(model.head_tiles_product, fullgraph=True)

    def run(x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x, (0, 0, 0, 1))
        torch._dynamo.mark_dynamic(x, 0)
        return compiled(x)[:-1]

    device = model.head_qweight.device
    with torch.inference_mode():  # (as the engine's steps run: another grad mode would be a recompile there)
        run(torch.zeros(amx_tiles.TILES_MIN_TOKENS + 1, model.config.hidden_size, dtype=model.dtype, device=device))
    model._head_tiles = run


def compile_each_layer(model) -> None:
    """The layer stack as a Python loop over one compiled decoder layer (model.layer_by_layer), for torch < 2.12.

    There, a nested compile region that writes its inputs (each layer's KV pools) is functionalised: the region
    wrote a new copy of both whole pools and the stack copied them back, every layer of every step (on an H200,
    2.0 of a 4.1 ms bf16 decode step at batch 8, 1B model: docs/benchmarks.md). A top-level compiled frame writes
    its inputs in place. The frame is traced once per variant (its guards read a layer's shapes, not which layer
    it is); a CUDA graph replays the loop's kernels without the Python, and prefill pays one guard check a layer."""
    compiled = torch.compile(decoder_layer, fullgraph=True, options=_options(model))

    def run(h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        return layer_by_layer(model, compiled, h, fb, compile_policy.mark_dynamic)

    model._run_layers = run
