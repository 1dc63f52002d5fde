"""Typed configuration: the model's (read from HF config.json) and the engine's (chosen by the operator)."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import torch

from .errors import CheckpointError
from .model.families import FAMILIES, SUPPORTED_ARCHITECTURES, Family  # noqa: F401 (SUPPORTED_ARCHITECTURES: re-exported)
from .model.packed_gemm import native_bf16
from .model.quantization import GROUP_SIZES, QUANTIZATIONS
from .sample.structured_output import GrammarLimits

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # model.ACTIVATIONS implements them
SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types
MergeMode = Literal["auto", "on", "off"]
MERGE_MODES: tuple[str, ...] = get_args(MergeMode)
KVGrowth = Literal["lazy", "reserve"]
KV_GROWTH_MODES: tuple[str, ...] = get_args(KVGrowth)
# What the KV pool stores (vLLM's and SGLang's --kv-cache-dtype): "auto", the model's dtype; "bfloat16", half of
# float32's bytes per token (twice the tokens in one budget), attention still computed in the model's dtype.
KVCacheDType = Literal["auto", "bfloat16"]
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KVCacheDType)
LoRAKernel = Literal["auto", "indexed", "grouped", "masked", "gathered", "stacked"]
LORA_KERNELS: tuple[str, ...] = get_args(LoRAKernel)
AttentionBackend = Literal["auto", "inductor", "sdpa"]
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackend)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str  # "linear", "llama3" or "longrope"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # longrope (Phi-3): per-frequency divisors below / from original_max_position_embeddings, and cos/sin's scale
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # qkv bias (Qwen2 always has it)
    o_proj_bias: bool
    mlp_bias: bool
    torch_dtype: torch.dtype
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Per layer, SLIDING or FULL (transformers' layer_types); empty: every layer is SLIDING when sliding_window is set.
    layer_types: tuple[str, ...] = ()
    hidden_act: str = "silu"
    partial_rotary_factor: float = 1.0       # rotary over the first head_dim x this of each head (Phi-3 variants)
    rope_local_theta: float | None = None    # sliding layers' rotary base, where it differs (Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (Gemma); None: head_dim ** -0.5
    attn_logit_softcapping: float | None = None   # scores -> tanh(scores / cap) * cap (Gemma 2)
    final_logit_softcapping: float | None = None  # likewise for the logits

    @property
    def family(self) -> Family:
        return FAMILIES[self.architecture]

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_sliding(self, layer: int) -> bool:
        return self.sliding_window is not None and (not self.layer_types or self.layer_types[layer] == SLIDING)

    @property
    def mixed_layers(self) -> bool:
        """Whether layers differ in window (and rotary base): the layers then read per-layer tensors."""
        return len({self.is_sliding(i) for i in range(self.num_hidden_layers)}) > 1

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: missing; a model directory needs a Hugging Face config.json")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from e
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"{source}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = FAMILIES[arch]
        raw = {**family.defaults, **raw}
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            dtype_name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
            if dtype_name not in _DTYPES:
                raise CheckpointError(f"{source}: unsupported torch_dtype {dtype_name!r}")
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            bias = bool(raw.get("attention_bias", False))
            act = raw.get(family.activation_key) or raw.get("hidden_act") or "silu"
            if act not in ACTIVATIONS:
                raise CheckpointError(f"{source}: unsupported activation {act!r}; supported: {', '.join(ACTIVATIONS)}")
            rope, local_rope = _rope_sections(raw)
            layers = int(raw["num_hidden_layers"])
            window = _sliding_window(raw)
            cfg = cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bias if family.qkv_bias is None else family.qkv_bias,
                o_proj_bias=bias if family.o_proj_bias is None else family.o_proj_bias,
                mlp_bias=bool(raw.get("mlp_bias", False)),
                torch_dtype=_DTYPES[dtype_name],
                rope_scaling=_rope_scaling(raw, rope, source),
                sliding_window=window,
                eos_token_ids=tuple(int(e) for e in eos_ids),
                layer_types=_layer_types(raw, family, layers, window, source),
                hidden_act=act,
                partial_rotary_factor=float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))),
                rope_local_theta=_local_theta(raw, local_rope, family, source),
                query_pre_attn_scalar=_optional_float(raw.get("query_pre_attn_scalar")),
                attn_logit_softcapping=_optional_float(raw.get("attn_logit_softcapping")),
                final_logit_softcapping=_optional_float(raw.get("final_logit_softcapping")),
            )
        except KeyError as e:
            raise CheckpointError(f"{source}: missing required key {e.args[0]!r}") from e
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise CheckpointError(f"{source}: num_attention_heads must be a multiple of num_key_value_heads")
        return cfg


def _rope_sections(raw: dict) -> tuple[dict, dict | None]:
    """The rotary settings of full-attention layers and, where given apart, of sliding ones. transformers 5 keeps
    them in "rope_parameters" (per layer type for Gemma 3); older files in "rope_theta" and "rope_scaling"."""
    params = raw.get("rope_parameters") or {}
    local = None
    if "full_attention" in params or "sliding_attention" in params:
        params, local = params.get("full_attention") or {}, params.get("sliding_attention")
    return {**params, **(raw.get("rope_scaling") or {})}, local


def _rope_scaling(raw: dict, rs: dict, source: str) -> RopeScaling | None:
    kind = rs.get("rope_type") or rs.get("type") or "default"
    if kind == "default":
        return None
    kind = {"su": "longrope"}.get(kind, kind)  # Phi-3's first configs' name for it
    if kind not in ("linear", "llama3", "longrope"):
        raise CheckpointError(f"{source}: unsupported rope_scaling type {kind!r}; supported: linear, llama3, longrope")
    original = int(rs.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings") or 8192)
    factor = rs.get("factor")
    attention_factor = rs.get("attention_factor")
    if kind == "longrope":
        # As transformers: the factor defaults to the context's growth, and the scale of cos/sin follows from it.
        factor = factor or int(raw.get("max_position_embeddings", original)) / original
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(
        rope_type=kind,
        factor=float(factor or 1.0),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        short_factor=tuple(float(f) for f in rs.get("short_factor") or ()),
        long_factor=tuple(float(f) for f in rs.get("long_factor") or ()),
        attention_factor=float(attention_factor or 1.0),
    )


def _local_theta(raw: dict, local: dict | None, family: Family, source: str) -> float | None:
    if not family.local_rope:
        return None
    local = local or {}
    if (local.get("rope_type") or "default") != "default":
        raise CheckpointError(f"{source}: sliding layers' rope_type {local['rope_type']!r} is not supported; default")
    return float(local.get("rope_theta", raw.get("rope_local_base_freq", 10000.0)))


def _sliding_window(raw: dict) -> int | None:
    if raw.get("use_sliding_window") is False:  # Qwen2 ships a window it does not use by default
        return None
    window = raw.get("sliding_window")
    return int(window) if window else None


def _layer_types(raw: dict, family: Family, layers: int, window: int | None, source: str) -> tuple[str, ...]:
    if window is None:
        return ()
    types = raw.get("layer_types")
    if types is None:  # an older config.json: the family's own pattern
        pattern = int(raw.get("sliding_window_pattern") or 1) if family.sliding_pattern == "pattern" else 2
        types = [FULL if family.sliding_pattern != "all" and (i + 1) % pattern == 0 else SLIDING for i in range(layers)]
    types = tuple(types)
    if len(types) != layers or not set(types) <= {SLIDING, FULL}:
        raise CheckpointError(f"{source}: layer_types must name {SLIDING!r} or {FULL!r} for each of {layers} layers")
    return types


def _optional_float(value) -> float | None:
    return None if value is None else float(value)


def cache_root() -> Path:
    """lora-serve's cache directory (compiled code, GGUF-derived files, the demo): $LORA_SERVE_CACHE, else
    ~/.cache/lora-serve."""
    env = os.environ.get("LORA_SERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lora-serve"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's element type for EngineConfig.kv_cache_dtype `name`."""
    return model_dtype if name == "auto" else _DTYPES[name]


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto": bfloat16 on CUDA and on CPUs that compute it natively (AVX-512 BF16 or AMX: decode streams half the
    bytes, 1.1-1.6x float32 there, docs/benchmarks.md), else float32 (emulated bf16 would be slower).
    float32 stays the exact reference: pass it explicitly to compare with a float32 model token for token."""
    if name == "auto":
        if device.type == "cuda" or (device.type == "cpu" and native_bf16()):
            return torch.bfloat16
        return torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
    return _DTYPES[name]


@dataclass
class EngineConfig:
    model: str                       # a Hugging Face model directory or a GGUF file (lora_compile.model.loader.source)
    # A directory whose tokenizer.json / tokenizer_config.json replace the model's (vLLM's --tokenizer).
    tokenizer: str | None = None
    max_num_seqs: int = 64           # running sequences (vLLM's name), whatever their lengths
    # The old name of max_num_seqs, kept as an alias: when given it sets max_num_seqs (and always reads the same).
    max_batch_size: int | None = None
    max_seq_len: int = 1024          # prompt + generated tokens per sequence
    # Per step: decode tokens + prefill chunk tokens. The trade-off of chunked prefill: larger chunks give long
    # prompts their first token sooner, smaller ones keep the running streams' gaps short. 512 against 256: TTFT
    # 0.98x at 1,000 tokens and 0.92x at 4,000 (bf16), 0.92x at 1,000 (f32); the P95 gap of 8 streams while a
    # 1,000-token prompt prefills 1.9x, still under vLLM-CPU's in the same run (docs/benchmarks.md, "Prefill").
    max_num_batched_tokens: int = 512
    max_loras_per_batch: int = 8     # device slots = distinct adapters in a batch (slot 0, the base model, on top)
    max_lora_rank: int = 16
    # How a step computes its adapters' LoRA deltas (compile_policy.lora_kernel decides "auto"): "indexed", each
    # token reads its own slot's A and B inside one fused reduction (the CPU's form); "grouped", tokens sorted by
    # slot and grouped GEMMs over the slots' segments (CUDA bf16); "masked", two plain GEMMs over every slot with
    # each token's own slot kept. The last two read each adapter's weights once, on tensor cores. "gathered": one
    # GEMM through every slot's A, then each token's own shrink and B read by index in one reduction fused with the
    # add; "stacked": the same with every slot's A stored under the base weight, the shrink inside the base GEMM.
    lora_kernel: LoRAKernel = "auto"
    # How attention reads the paged KV cache (compile_policy.attention_backend and prefill_attention_backend decide
    # "auto" per phase): "inductor", the reductions Inductor generates over the block table (the CPU's decode);
    # "sdpa", K and V gathered per sequence, then torch's fused scaled_dot_product_attention kernels (prompt chunks
    # everywhere, CUDA's decode). An explicit value holds for both phases.
    attention_backend: AttentionBackend = "auto"
    # Host cache of adapters' weights, LRU; None: 1/8 of the memory available when the engine starts.
    max_cpu_lora_bytes: int | None = None
    # Served on demand: a request's adapter that is not registered is read from <dir>/<name>/ (also adapter roots).
    adapter_dirs: tuple[str, ...] = ()
    adapter_loader_threads: int = 2  # read + validate adapters off the engine thread
    device: str = "auto"
    dtype: str = "auto"
    compile: bool = True
    # With compile: save the traced and compiled layer stack in the Inductor cache directory and load it on the next
    # start, which then runs no Dynamo tracing (precompile). Off: torch.compile traces the stack at every start.
    precompile: bool = True
    # On CUDA with compile: decode steps replay CUDA graphs, one per (batch bucket, key bucket, with/without
    # adapters), captured on first use (lora_compile.core.cuda_graphs). Off: every step launches its kernels.
    cuda_graphs: bool = True
    # Fill the next decode step's metadata on the host while this step runs on the device (lora_compile.core.step_ahead).
    # None: on CUDA, where the device would otherwise wait for it; on the CPU the forward holds the cores anyway.
    overlap_batch_init: bool | None = None
    # CPU float32: run base projections on oneDNN-packed weights (2-3x faster GEMMs at decode sizes; a second
    # copy of the weights). Ignored where packed_gemm is not available.
    prepack_weights: bool = True
    # With packed weights: once `merge_after_steps` consecutive steps use one adapter alone, run them on that adapter
    # merged into another packed copy of the projection weights (lora/merge.py). "auto": where that copy fits in half
    # the memory available after loading; "on" / "off" force it. A merge costs several steps' time (spread over
    # steps), so a batch must stay on one adapter for a while before it pays for one.
    merge_lone_adapter: MergeMode = "auto"
    merge_after_steps: int = 16
    # With compile: Inductor's cache directory (the saved layer stack goes there too). Set for the whole process
    # as TORCHINDUCTOR_CACHE_DIR, torch's only setting for it; None: an operator's TORCHINDUCTOR_CACHE_DIR, else
    # ~/.cache/lora-serve/inductor (compile_policy.configure).
    inductor_cache_dir: str | None = None
    adapter_roots: tuple[str, ...] = ()  # empty: any directory may be registered (local/offline use)
    seed: int = 0
    # Paged KV cache (lora_compile.kv_cache). Bytes of K/V for the whole pool; None: on CPU a share of the memory
    # available at start (KV_HOST_SHARE, at most KV_HOST_MAX_BYTES), on CUDA gpu_memory_utilization of the free
    # memory after weights; either way no more than KV_MAX_SEQ_FILLS x max_num_seqs x max_seq_len tokens.
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    block_size: int = 16             # tokens per KV block
    enable_prefix_caching: bool = True
    # "lazy": a sequence takes blocks as it grows and the newest running one is preempted (recomputed later)
    # when none is free; "reserve": admission takes blocks for prompt + max_new_tokens at once, never preempts.
    kv_growth: KVGrowth = "lazy"
    # "bfloat16" with a float32 model: keys and values rounded to bfloat16 when written (8 mantissa bits), so
    # greedy output may part from the float32 reference at a near-tie; "auto" keeps the exact reference.
    kv_cache_dtype: KVCacheDType = "auto"
    # Structured outputs: what one constraint may cost (structured_output.GrammarLimits). Compiling it and its first
    # mask run off the engine thread within a time and a memory budget, or it is refused; compiled ones are kept up
    # to a total; a step's grammar work (masks, consuming the sampled tokens) waits at most the step timeout, after
    # which the sequences not done end with an error and the others go on.
    # Base weights' form (lora_compile/model/quantization/; vLLM's --quantization): "gguf" keeps a GGUF's blocks where a kernel
    # computes them exactly, "auto" is "gguf" in bfloat16 / float16 and "none" otherwise, "int8" / "int4" quantize
    # at load (int4 in groups of quantization_group_size), "none" keeps every weight at full width.
    quantization: str = "auto"
    quantization_group_size: int = 32
    structured_output_compile_timeout_s: float = 2.0
    structured_output_max_memory_mb: int = 64
    structured_output_cache_mb: int = 256
    structured_output_step_timeout_ms: float = 100.0

    def grammar_limits(self) -> GrammarLimits:
        return GrammarLimits(self.structured_output_compile_timeout_s, self.structured_output_max_memory_mb << 20,
                             self.structured_output_cache_mb << 20, self.structured_output_step_timeout_ms / 1000)

    def __post_init__(self) -> None:
        if self.max_batch_size is not None:
            self.max_num_seqs = self.max_batch_size
        self.max_batch_size = self.max_num_seqs
        for name in ("max_num_seqs", "block_size", "max_seq_len", "max_num_batched_tokens", "max_loras_per_batch", "max_lora_rank",
                     "merge_after_steps", "adapter_loader_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_seq_len < 3:  # a prefill group reads at least 3 positions (forward_batch.PLACEHOLDER_KEYS)
            raise ValueError(f"max_seq_len must be >= 3, got {self.max_seq_len}")
        if self.max_cpu_lora_bytes is not None and self.max_cpu_lora_bytes < 0:
            raise ValueError(f"max_cpu_lora_bytes must be >= 0, got {self.max_cpu_lora_bytes}")
        if self.merge_lone_adapter not in MERGE_MODES:
            raise ValueError(f"merge_lone_adapter must be one of {', '.join(MERGE_MODES)}, got {self.merge_lone_adapter!r}")
        if self.max_num_batched_tokens <= self.max_num_seqs:
            # every step must leave room for at least one prefill token besides the decodes
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be larger than "
                             f"max_num_seqs ({self.max_num_seqs})")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization_group_size not in GROUP_SIZES:
            raise ValueError(f"quantization_group_size must be one of {', '.join(map(str, GROUP_SIZES))}, got "
                             f"{self.quantization_group_size}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got "
                             f"{self.attention_backend!r}")
        if self.lora_kernel not in LORA_KERNELS:
            raise ValueError(f"lora_kernel must be one of {', '.join(LORA_KERNELS)}, got {self.lora_kernel!r}")
        if self.kv_growth not in KV_GROWTH_MODES:
            raise ValueError(f"kv_growth must be one of {', '.join(KV_GROWTH_MODES)}, got {self.kv_growth!r}")
        for name in ("structured_output_compile_timeout_s", "structured_output_max_memory_mb",
                     "structured_output_cache_mb", "structured_output_step_timeout_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
