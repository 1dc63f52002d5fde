"""Every torch.compile decision of the project, in one place.

- Regional compilation: the decoder layer is compiled once (fullgraph) and its graph serves all layers.
- Sizes that change between steps are marked dynamic; dims are padded to >= 2 so that 0/1 specialisation
  cannot add graphs after warm-up. Deliberate variants: no adapter in the step (no LoRA work at all), and
  adapters (any mix: per-token slot indices, one graph).
- After warm-up, steps run under `fail_on_recompile`: a surprise recompile is an error, not a slowdown.
- The Inductor cache directory persists across restarts, so a warm start skips code generation.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from .forward_batch import ForwardBatch


def default_inductor_cache_dir() -> Path:
    base = os.environ.get("LORA_SERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lora-serve")
    return Path(base) / "inductor"


def configure(cache_dir: str | None) -> None:
    """cache_dir wins; else an operator's TORCHINDUCTOR_CACHE_DIR; else ours (not torch's /tmp default)."""
    if cache_dir or "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        path = Path(cache_dir) if cache_dir else default_inductor_cache_dir()
        path.mkdir(parents=True, exist_ok=True)
        # Assigned, not setdefault: once Inductor has run, torch has written its own default here.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True
    # Separate symbols for equal-sized dims at trace time; otherwise a later mismatch would recompile.
    torch.fx.experimental._config.use_duck_shape = False
    # Several models in one process (tests) each add entries for the shared decoder-layer code.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 512)


def compile_layers(layers: torch.nn.ModuleList) -> None:
    for layer in layers:
        layer.compile(fullgraph=True)


def mark_token_dim(hidden: torch.Tensor) -> None:
    """The layers' input is made per step (embedding output): its token dim varies."""
    torch._dynamo.mark_dynamic(hidden, 0)


def mark_dynamic(fb: ForwardBatch) -> None:
    """Mark every step-varying dim dynamic (all are >= 2 by construction: a step has a dummy token)."""
    md = fb.attn
    tensors = [
        (fb.cos, (0,)), (fb.sin, (0,)), (md.slot_mapping, (0,)), (md.decode_token_idx, (0,)),
        (md.decode_q_pos, (0,)), (md.decode_kv_slots, (0,)), (md.decode_key_pos, (0,)),
        (md.prefill_token_idx, (0, 1)), (md.prefill_q_pos, (0, 1)), (md.prefill_kv_slots, (0,)),
        (md.prefill_key_pos, (0,)), (md.out_idx, (0,)),
    ]
    if fb.lora.weight_indices is not None:
        tensors.append((fb.lora.weight_indices, (0,)))
    for tensor, dims in tensors:
        for d in dims:
            torch._dynamo.mark_dynamic(tensor, d)


def steady_state(enabled: bool):
    """Context for steps after warm-up."""
    return torch.compiler.set_stance("fail_on_recompile") if enabled else contextlib.nullcontext()
