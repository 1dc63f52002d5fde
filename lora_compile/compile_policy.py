"""Every torch.compile decision of the project, in one place.

- The layer stack is one compiled frame (fullgraph) in which the decoder layer is a nested compile region:
  Dynamo traces and Inductor compiles the layer once, and the step calls that code for every layer. A step then
  pays guard checks and wrapper set-up once, not once per layer (as compiling each layer separately did).
- Sizes that change between steps are marked dynamic; dims are padded to >= 2 so that 0/1 specialisation
  cannot add graphs after warm-up. Deliberate variants: no adapter in the step (no LoRA work at all), and
  adapters (any mix: per-token slot indices, one graph).
- After warm-up, steps run under `fail_on_recompile`: a surprise recompile is an error, not a slowdown.
- The Inductor cache directory persists across restarts, so a warm start skips code generation; the traced and
  compiled stack itself is saved there too (precompile), so a warm start skips Dynamo's tracing as well.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import os
from pathlib import Path

import torch

from .config import cache_root
from .model import onednn_float32
from .model.forward_batch import ForwardBatch

log = logging.getLogger(__name__)


def default_inductor_cache_dir() -> Path:
    return cache_root() / "inductor"


def configure(cache_dir: str | None) -> Path:
    """Set the process-wide compile settings the engine needs (EngineConfig.compile) and return the Inductor cache
    directory: `cache_dir`; else an operator's TORCHINDUCTOR_CACHE_DIR; else ours (not torch's /tmp default).

    Inductor has no setting for that directory but the TORCHINDUCTOR_CACHE_DIR environment variable (torch reads
    it, and hands it to its compile workers), so this sets the variable when it chooses the directory: the one
    environment change lora_compile makes, documented on EngineConfig.inductor_cache_dir."""
    if cache_dir or "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        path = Path(cache_dir) if cache_dir else default_inductor_cache_dir()
        path.mkdir(parents=True, exist_ok=True)
        # Assigned, not setdefault: once Inductor has run, torch has written its own default here.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
        log.info("Inductor cache directory %s (TORCHINDUCTOR_CACHE_DIR set for this process)", path)
    torch._inductor.config.fx_graph_cache = True
    # The generated wrapper checks every input's and extern kernel output's size and stride on each call (~14 Python
    # calls per layer, 30 layers a step); the inputs are guarded already and our one extern op's outputs are
    # contiguous by construction (packed_gemm). vLLM's CPU backend turns them off too.
    torch._inductor.config.size_asserts = False
    # Inductor splits a CPU loop over the threads only where its size hint promises min_chunk_size (512)
    # elements a thread. The hints are warm-up's sizes (3 decodes, one KV block), so decode attention's softmax
    # passes ran on one core while the other waited, at any batch. At 1 every loop with two units of work is
    # shared: decode steps 3-6 % shorter at batch 32, 1-4 % at 8 (docs/benchmarks.md).
    torch._inductor.config.cpp.min_chunk_size = 1
    torch._functorch.config.enable_autograd_cache = True
    # Separate symbols for equal-sized dims at trace time; otherwise a later mismatch would recompile.
    torch.fx.experimental._config.use_duck_shape = False
    # A model's floats (attention scale, soft-caps) are constants of its graph: unspecialised, a second model with
    # other values (tests) would make them symbolic, which torch.cond's operands may not be.
    torch._dynamo.config.specialize_float = True
    # Likewise sizes: the dims that vary are marked (ForwardBatch's dynamic fields), every other one is the model's.
    # Left automatic, a second model's other KV pool size turned symbolic, and torch 2.13 failed reusing the layer
    # region over it (KeyError in invoke_subgraph's stamp-out).
    torch._dynamo.config.automatic_dynamic_shapes = False
    # Several models in one process (tests) each add entries for the shared decoder-layer code.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 512)
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def _layer_variant(layer, x, *batch) -> int:
    """Which traced layer a call reuses. Every layer of a model is built from the same config (same shapes,
    dtypes; what differs per layer, Gemma's window and rotary table, is a tensor of the layer), so the differences
    between calls are whether the step carries adapters and the forms the layer's weights are held in (a GGUF's
    layers may differ: quantization.plan). Keying on them skips comparing each call's inputs against the first
    trace (seconds of every start)."""
    return layer.form_key * 3 + ForwardBatch.flat_variant(batch)


# torch 2.12 added reuse_hash_fn. Before it, Dynamo traces every layer's call and reuses identical graphs (slower
# starts), and the layer stack is not saved (core.compiled_stack): the saved form is only checked on torch >= 2.12.
REUSE_HASH = "reuse_hash_fn" in inspect.signature(torch.compiler.nested_compile_region).parameters

# Marks the decoder layer's forward inside the compiled stack (eager calls the layers directly).
repeated_region = (torch.compiler.nested_compile_region(reuse_hash_fn=_layer_variant) if REUSE_HASH
                   else torch.compiler.nested_compile_region())


def unaliased(batch: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
    """The step's metadata (ForwardBatch.flat()) as separate tensors. They are views of one buffer (one copy per
    step), and the inputs of a nested region may not alias each other; inside the compiled frame this is one small
    copy kernel."""
    return tuple(None if t is None else t.clone() for t in batch)


def mark_dynamic(h: torch.Tensor, fb: ForwardBatch) -> None:
    """Mark every step-varying dim of the stack's inputs dynamic: the hidden states' rows (one per token) and the
    dims each ForwardBatch field declares. Needed where Dynamo traces, and where its guards check the marks (every
    call of a traced stack); a saved stack checks sizes only, so its steps skip this (~1 ms a step on 2 cores)."""
    for tensor, dims in [(h, (0,)), *fb.dynamic_dims()]:
        for d in dims:
            torch._dynamo.mark_dynamic(tensor, d)


# The kernels that run as GEMMs over the slots: they read B block-diagonal (LoRALinear.block_diagonal_b) and what
# LoRABatch.derive computes on the device each step.
GEMM_KERNELS = ("grouped", "masked")
# The kernels whose expand reads each token's own slot's shrink and B by index (lora_deltas.gathered), B
# compact: "gathered" (a GEMM through every slot's A) and "stacked" (every slot's A stored under the base weight, so
# the base GEMM gives the shrink too; a quantized projection takes the gathered form). In Inductor's code for a
# compiled layer, against a base-model step, masked adds 8 GEMMs and 4 kernels, gathered 4 GEMMs, stacked nothing
# (the expand fused into kernels the layer runs anyway; counted on the CPU: python -m benchmarks.lora_kernel_count).
# Built for CUDA, where each kernel's launch bounds a decode step's LoRA time (docs/benchmarks.md section 9); not
# yet measured on a GPU.
GATHERED_KERNELS = ("gathered", "stacked")
# The grouped kernel's tensor-core path (CUTLASS, sm90+) needs 16-byte-aligned rows: ranks in multiples of 8 bf16.
GROUPED_RANK_MULTIPLE = 8


def lora_kernel(requested: str, device: torch.device, dtype: torch.dtype, max_rank: int, compiled: bool) -> str:
    """The LoRA form of the step (EngineConfig.lora_kernel), decided here and only here.

    "auto": "masked" on CUDA (GEMMs over every slot, each token's own kept: each adapter's weights read once, on
    tensor cores, in three kernels a projection; 0.90-0.98x of the base model's decode with 8 adapters on an H100,
    against 0.70-0.74x for "grouped" and 0.53-0.56x for "indexed", and prefill within noise of base, with 8 slots:
    docs/benchmarks.md); "indexed" on the CPU, where it beats GEMMs per adapter (python -m benchmarks.lora_layer),
    in bfloat16 with long steps grouped (INDEXED_GROUPED: lora_grouped_prefill).
    "grouped" (torch's grouped GEMM over per-slot segments) compiles for bfloat16 only and needs ranks in multiples
    of 8; asked for on the CPU it also runs eagerly in any dtype (how the tests check it against peft)."""
    if requested in ("indexed", "masked", *GATHERED_KERNELS):  # plain reductions or GEMMs: any device and dtype
        return requested
    if requested == "grouped":
        if max_rank % GROUPED_RANK_MULTIPLE or (compiled and dtype != torch.bfloat16):
            raise ValueError(f"lora_kernel 'grouped' needs max_lora_rank in multiples of {GROUPED_RANK_MULTIPLE} "
                             f"(got {max_rank}) and, compiled, bfloat16 (got {dtype}): torch's grouped_mm compiles "
                             "for bfloat16 only")
        return "grouped"
    if device.type == "cuda":
        return "masked"
    grouped_ok = dtype == torch.bfloat16 and max_rank % GROUPED_RANK_MULTIPLE == 0
    return INDEXED_GROUPED if grouped_ok else "indexed"


# The CPU's "auto" kernel in bfloat16: indexed, with the shrink grouped in steps of at least LORA_GROUPED_MIN_TOKENS
# tokens (a prefill chunk's), where the indexed reductions cost most: 8 x 1,000-token prompts with 8 distinct adapters
# took 1.34x the base model's time indexed, 1.25x with the shrink grouped (Xeon; the expand grouped per slice too
# since, lora_deltas._expand_grouped_compact: 7.03 -> 6.75 s on an EPYC), while decode steps with 8 adapters
# ran 2.2-2.8x slower grouped (docs/benchmarks.md). Grouped GEMMs compile for bfloat16 only, ranks in multiples of 8.
# ("indexed" asked for by name is indexed in every step.)
INDEXED_GROUPED = "indexed+grouped"
LORA_GROUPED_MIN_TOKENS = 256


def lora_grouped_prefill(kernel: str) -> bool:
    """Whether long steps take the grouped kernel (LoRABatch.derive per step) and short ones the indexed one."""
    return kernel == INDEXED_GROUPED


# The CPU's bfloat16 indexed expand reads B chunk-major in runs of this many outputs (LoRALinear.b_chunk): one
# vector of Inductor's (32 lanes), one 64-byte cache line.
LORA_B_CHUNK = 32


def lora_b_chunk(kernel: str, device: torch.device, dtype: torch.dtype, output_sizes: tuple[int, ...]) -> int:
    """How a projection stores B (LoRALinear.b_chunk): chunk-major for the CPU's indexed kernel in bfloat16, when
    every slice divides into chunks (8 adapters: decode steps 0.925x at batch 8 and 0.952x at 32, every round
    shorter; in float32 1.005x and 1.035x, so float32 keeps rank rows: python -m benchmarks.lora_layer
    --engine-b-layout, docs/benchmarks.md); 0 (rank rows, outputs innermost) elsewhere: CUDA's kernels read B as
    GEMM operands."""
    if (kernel not in ("indexed", INDEXED_GROUPED) or device.type != "cpu" or dtype != torch.bfloat16
            or any(size % LORA_B_CHUNK for size in output_sizes)):
        return 0
    return LORA_B_CHUNK


def decode_attention_per_block(device: torch.device) -> bool:
    """Decode attention's P·V form (model.attend_decode), decided here: summed per KV block, then over the blocks,
    on the CPU (a block's V stays in L1 while every vector lane passes over it: a batch-32 step at 400-token
    contexts 0.85-0.93x the time, docs/benchmarks.md); one sum over all keys on CUDA, the form measured there."""
    return device.type == "cpu"


def skip_placeholder_prefill(device: torch.device) -> bool:
    """Whether a compiled decode-only step skips its placeholder prefill group through torch.cond
    (model.attend_prefill): on the CPU, inside the one-frame stack. A frame of its own per layer (torch < 2.12)
    cannot take torch.cond over the KV pools that frame writes (its branches would alias a mutated input)."""
    return device.type == "cpu" and REUSE_HASH


def attention_backend(requested: str, device: torch.device, softcap: float | None) -> str:
    """How attention reads the paged KV cache (EngineConfig.attention_backend), decided here and only here.

    "auto": "sdpa" on CUDA (torch's fused attention kernels over K/V gathered per sequence: the generated
    reductions read the keys at a fraction of the bandwidth there, docs/benchmarks.md), "inductor" on the CPU
    (the block-by-block reductions measured fastest there: decode_attention_per_block). Soft-capped scores
    (Gemma 2) have no SDPA form: "inductor" always."""
    if requested == "sdpa" and softcap is not None:
        raise ValueError("attention_backend 'sdpa' cannot soft-cap attention scores (this model's "
                         "attn_logit_softcapping): use 'inductor'")
    if requested != "auto":
        return requested
    return "sdpa" if device.type == "cuda" and softcap is None else "inductor"


def prefill_attention_backend(requested: str, softcap: float | None) -> str:
    """How a step's prompt chunks attend (decided here and only here; attention_backend decides decode).

    "auto": "sdpa" on every device: torch's fused attention (its flash kernel for the CPU) over K/V gathered per
    sequence. On the CPU the generated reductions materialise every (query, key) score in float32 and run the
    products as bmm calls: a 1,000-token prompt took 1.8x sdpa's time to first token, a 4,000-token one 2.1x
    (bfloat16, a Xeon with AMX: python -m benchmarks.prefill, docs/benchmarks.md); decode keeps them (one query
    a sequence, where they measured faster). Soft-capped scores have no SDPA form; an explicit backend holds for
    both phases."""
    if requested != "auto":
        return requested
    return "inductor" if softcap is not None else "sdpa"


def prefill_attention_float32(device: torch.device, compiled: bool) -> bool:
    """Whether prompt chunks' fused attention computes in float32 whatever the activations' dtype: compiled on the
    CPU, as its generated reductions did (eager keeps the activations' dtype, as transformers computes: the eager
    bfloat16 tests compare tokens with it). torch's CPU flash kernel in bfloat16 rounds the probabilities to bfloat16
    before P·V, and the demo's bfloat16 answer to its README question turned from Paris to another; in float32 it
    answers Paris. The cost, bf16 weights on a Xeon with AMX: 1,000- and 4,000-token prompts' first tokens took
    1.26x and 1.71x the bfloat16 kernel's time (two runs of python -m benchmarks.prefill, docs/benchmarks.md)."""
    return compiled and device.type == "cpu"


def prefill_attention_onednn(device: torch.device) -> bool:
    """Whether prompt chunks' float32 attention (torch's CPU flash kernel, or the bmm form of `attend`) runs its
    products through oneDNN rather than MKL's sgemm: where a float32 product stays float32 in oneDNN under
    `fp32_precision = "bf16"`, the one setting under which torch's CPU BLAS and matmul hand float32 products to
    oneDNN (set for that call only: model.onednn_float32). On an AMD EPYC (AVX-512 with BF16, no AMX) oneDNN ran
    them as float32 (its avx512_core brgemm; errors against float64 unchanged, operands bfloat16 does not hold
    included) at 391 GFLOP/s where MKL's sgemm ran 106: the kernel took 0.57-0.61x its time at 512 to 4,000 keys (docs/benchmarks.md
    section 4). Where oneDNN would round them to bfloat16 (as its AMX kernels may), the probe says so and MKL
    stays."""
    global _ONEDNN_KEEPS_FLOAT32
    if device.type != "cpu":
        return False
    if _ONEDNN_KEEPS_FLOAT32 is None:  # (CausalLM asks first, eagerly: never while the compiler traces)
        _ONEDNN_KEEPS_FLOAT32 = _onednn_keeps_float32()
    return _ONEDNN_KEEPS_FLOAT32


_ONEDNN_KEEPS_FLOAT32: bool | None = None


def _onednn_keeps_float32() -> bool:
    """A float32 product of values bfloat16 does not hold, through that route, is float32's (once a process)."""
    if not torch.backends.mkldnn.is_available():
        return False
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 64, generator=gen), torch.randn(64, 512, generator=gen)
    got = onednn_float32.matmul(a, b)
    return bool((got.double() - a.double() @ b.double()).abs().max() < 1e-4)  # bfloat16 inputs: ~1e-2


def inductor_options(device: torch.device, weight_forms: list[dict]) -> dict:
    """Inductor settings of the compiled layer stack beyond configure's process-wide ones, decided here.

    On CUDA, where a projection holds int8 codes with a scale a row (quantization.linear: the codes widened to the
    activations' dtype, then the GEMM), GEMMs are autotuned (`max_autotune_gemm`): Inductor's Triton GEMM templates
    then take the widening as their prologue (prologue fusion) and read one byte a weight, as torchao's int8
    weight-only form relies on; without them the step writes the widened weight out and reads it again, more bytes
    than the bfloat16 weight's. torch's own CUDA int8 weight-only kernel computes each output row apart. Not yet
    measured on a GPU (docs/benchmarks.md section 9)."""
    int8_rows = any(f.kind == "int8" and not f.group_size for forms in weight_forms for f in forms.values())
    return {"max_autotune_gemm": True} if device.type == "cuda" and int8_rows else {}


def steady_state(enabled: bool):
    """Context for steps after warm-up."""
    return torch.compiler.set_stance("fail_on_recompile") if enabled else contextlib.nullcontext()
