"""The decoder of every family (families.py: Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3) with fused qkv / gate_up
projections and LoRA slots."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import compile_policy
from ..config import ModelConfig
from . import packed_gemm, quantization
from .attention import attend, attend_decode, attend_prefill
from .attention_sdpa import kv_rows, sdpa_decode
from .families import LORA_TARGETS, UNFUSED  # noqa: F401 (LORA_TARGETS: re-exported)
from .forward_batch import AttentionMetadata, ForwardBatch
from .layers import LoRALinear, RMSNorm, apply_rotary
from .loader.checkpoint import SafetensorsCheckpoint
from .packed_gemm import linear

# Llama's tables (families.py): what the demo model and most adapters use; a model's own come from its family.
PROJECTIONS = UNFUSED
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
# A full-attention layer's window where layers differ (ModelConfig.mixed_layers): wider than any sequence.
NO_WINDOW = 1 << 40


def lora_targets(cfg: ModelConfig) -> dict[str, str]:
    """Modules an adapter of this model may target (PEFT's names, in layer order) -> their path in a layer."""
    return cfg.family.lora_targets()


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each module of lora_targets(cfg), as the checkpoint stores it."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "qkv_proj": (h, q + 2 * kv), "o_proj": (q, h),
              "gate_proj": (h, i), "up_proj": (h, i), "gate_up_proj": (h, 2 * i), "down_proj": (i, h)}
    return {m: shapes[m] for m in lora_targets(cfg)}


def projection_tensors(cfg: ModelConfig) -> tuple[dict[str, tuple[str, ...]], dict[str, list[str]], dict[str, int]]:
    """What quantization.plan reads: each projection path's modules, each module's checkpoint tensor in every
    layer, each path's input size."""
    paths, shapes = lora_targets(cfg), module_shapes(cfg)
    projections = dict(cfg.family.projections)
    names = {m: [f"model.layers.{i}.{paths[m]}.weight" for i in range(cfg.num_hidden_layers)]
             for modules in projections.values() for m in modules}
    return projections, names, {path: shapes[modules[0]][0] for path, modules in projections.items()}


def _projection(cfg: ModelConfig, path: str, bias: bool, max_loras: int, max_rank: int, dtype, device,
                lora_kernel: str, forms: dict[str, quantization.WeightForm] | None = None) -> LoRALinear:
    """The LoRALinear at `path` of the family's projections: its modules' outputs side by side, its base weight in
    the form `forms` gives it (quantization.plan; none: full width)."""
    shapes = module_shapes(cfg)
    modules = cfg.family.projections[path]
    sizes = tuple(shapes[m][1] for m in modules)
    form = (forms or {}).get(path, quantization.NONE)
    return LoRALinear(shapes[modules[0]][0], sizes, bias, max_loras, max_rank, dtype, device,
                      block_diagonal_b=lora_kernel in compile_policy.GEMM_KERNELS,
                      b_chunk=compile_policy.lora_b_chunk(lora_kernel, torch.device(device), dtype, sizes),
                      quant=form.kind, group_size=form.group_size, stacked_a=lora_kernel == "stacked",
                      gathered=lora_kernel in compile_policy.GATHERED_KERNELS)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, dtype, device, lora_kernel: str = "indexed",
                 index: int = 0, attention_backend: str = "inductor",
                 forms: dict[str, quantization.WeightForm] | None = None, prefill_backend: str | None = None):
        super().__init__()
        # compile_policy.attention_backend / prefill_attention_backend: torch's fused kernels, per phase
        self.sdpa = attention_backend == "sdpa"
        self.prefill_sdpa = (prefill_backend or attention_backend) == "sdpa"
        # (its probe product runs here, eagerly, not while the compiler traces the layer)
        compile_policy.prefill_attention_onednn(torch.device(device))
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv_sizes = (cfg.q_size, cfg.kv_size, cfg.kv_size)
        self.scale = cfg.attention_scale
        self.softcap = cfg.attn_logit_softcapping
        self.sliding_window = cfg.sliding_window if cfg.is_sliding(index) else None
        # Where layers differ (Gemma 2 / 3), the window and the rotary table are per-layer tensors, read inside the
        # one compiled layer: a Python value would be traced into the graph that every layer reuses.
        self.register_buffer("window", None, persistent=False)
        self.register_buffer("local", None, persistent=False)  # picks the sliding layers' rotary table
        if cfg.mixed_layers:
            sliding = cfg.is_sliding(index)
            self.window = torch.tensor(cfg.sliding_window if sliding else NO_WINDOW, device=device)
            if cfg.rope_local_theta is not None:
                self.local = torch.tensor(sliding, device=device)
        lora = (max_loras, max_rank, dtype, device, lora_kernel, forms)
        self.qkv_proj = _projection(cfg, "self_attn.qkv_proj", cfg.attention_bias, *lora)
        self.o_proj = _projection(cfg, "self_attn.o_proj", cfg.o_proj_bias, *lora)
        norm = (cfg.head_dim, cfg.rms_norm_eps, dtype, device, cfg.family.norm_offset)
        self.q_norm = RMSNorm(*norm) if cfg.family.qk_norm else None
        self.k_norm = RMSNorm(*norm) if cfg.family.qk_norm else None
        # Allocated by the engine once it knows its capacity (allocate_kv_cache).
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype, device) -> None:
        """The layer's K and V pools: `num_blocks` blocks (the null block included). Zeroed, so the whole budget
        is resident from the start (no memory growth as blocks are first used)."""
        shape = (num_blocks, block_size, self.n_kv, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x, fb.lora, fb.compiled)
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)  # (one LoRALinear slice each, or one for all: Phi-3)
        # reshape, not view: on CPU the projection's output is a transposed layout (see packed_gemm.plain_linear)
        q = q.reshape(tokens, self.n_heads, self.head_dim)
        k = k.reshape(tokens, self.n_kv, self.head_dim)
        v = v.reshape(tokens, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = fb.cos, fb.sin
        if cos.dim() == 3:  # full-attention and sliding layers' tables (layers.rope_tables)
            cos = torch.where(self.local, cos[:, 1], cos[:, 0])
            sin = torch.where(self.local, sin[:, 1], sin[:, 0])
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        md: AttentionMetadata = fb.attn
        window = self.sliding_window if self.window is None else self.window
        # Write this step's keys/values first, so each query block reads its own chunk from the cache too.
        # Indexed by (block, offset) on the pools themselves, not through a flat view: Inductor writes a graph
        # input in place only where the write's target is that input; through a view, torch 2.11 kept the write
        # functional and copied each whole pool back, twice a layer (docs/benchmarks.md, the H200 run).
        bs = self.k_cache.shape[1]
        block, offset = md.slot_mapping // bs, md.slot_mapping % bs
        self.k_cache[block, offset] = k.to(self.k_cache.dtype)
        self.v_cache[block, offset] = v.to(self.v_cache.dtype)
        if self.sdpa:
            rows = kv_rows(md.decode_block_table, md.decode_key_pos, self.k_cache.shape[1])
            decode = sdpa_decode(q, self.k_cache, self.v_cache, md.decode_token_idx, md.decode_q_pos, rows,
                                 self.scale, window)
        elif fb.compiled:
            decode = attend_decode(q, self.k_cache, self.v_cache, md.decode_token_idx, md.decode_q_pos,
                                   md.decode_block_table, md.decode_key_pos, self.scale, window,
                                   self.softcap)
        else:
            decode = attend(q, self.k_cache, self.v_cache, md.decode_token_idx[:, None], md.decode_q_pos[:, None],
                            md.decode_block_table, md.decode_key_pos, self.scale, window,
                            softcap=self.softcap)
        prefill = attend_prefill(q, self.k_cache, self.v_cache, md, self.scale, window, fb.compiled,
                                 self.softcap, self.prefill_sdpa)
        out = torch.cat([decode, prefill], dim=0)[md.out_idx]
        return self.o_proj(out, fb.lora, fb.compiled)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, dtype, device, lora_kernel: str = "indexed",
                 forms: dict[str, quantization.WeightForm] | None = None):
        super().__init__()
        lora = (max_loras, max_rank, dtype, device, lora_kernel, forms)
        self.gate_up_proj = _projection(cfg, "mlp.gate_up_proj", cfg.mlp_bias, *lora)
        self.down_proj = _projection(cfg, "mlp.down_proj", cfg.mlp_bias, *lora)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        gate, up = self.gate_up_proj(x, fb.lora, fb.compiled).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up, fb.lora, fb.compiled)


class DecoderLayer(nn.Module):
    """The unit of compilation: one compiled region serves every layer (compile_policy)."""

    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, dtype, device, lora_kernel: str = "indexed",
                 index: int = 0, attention_backend: str = "inductor",
                 forms: dict[str, quantization.WeightForm] | None = None, prefill_backend: str | None = None):
        super().__init__()
        self.table = cfg.family.projections
        # Layers whose projections hold their weights in other forms (quantization.plan) trace to other graphs.
        self.form_key = quantization.form_key(forms or {})
        norm = (cfg.hidden_size, cfg.rms_norm_eps, dtype, device, cfg.family.norm_offset)
        self.input_layernorm = RMSNorm(*norm)
        self.self_attn = Attention(cfg, max_loras, max_rank, dtype, device, lora_kernel, index, attention_backend, forms,
                                   prefill_backend)
        self.post_attention_layernorm = RMSNorm(*norm)
        self.mlp = MLP(cfg, max_loras, max_rank, dtype, device, lora_kernel, forms)
        # Gemma's: post_attention_layernorm normalises the attention's output, these the MLP's input and output.
        sandwich = cfg.family.sandwich_norms
        self.pre_feedforward_layernorm = RMSNorm(*norm) if sandwich else None
        self.post_feedforward_layernorm = RMSNorm(*norm) if sandwich else None

    def projections(self) -> list[tuple[LoRALinear, tuple[str, ...]]]:
        """Each projection with the checkpoint modules it packs (the family's projections table)."""
        return [(self.get_submodule(path), modules) for path, modules in self.table.items()]

    def forward(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        if self.pre_feedforward_layernorm is None:
            h = x + self.self_attn(self.input_layernorm(x), fb)
            return h + self.mlp(self.post_attention_layernorm(h), fb)
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), fb))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h), fb))


def decoder_layer(layer: DecoderLayer, x: torch.Tensor, *batch: torch.Tensor | None) -> torch.Tensor:
    """One layer over plain arguments (tensors, None), which the compiler matches quickly between calls; forward
    directly, not layer(x, fb), so that no module-call machinery is traced per layer."""
    return layer.forward(x, ForwardBatch.from_flat(batch, compiled=True))


# The compiled region of the one-frame stack (compile_policy).
_decoder_layer = compile_policy.repeated_region(decoder_layer)


def layer_stack(model: CausalLM, h: torch.Tensor, *batch: torch.Tensor | None) -> torch.Tensor:
    """Every decoder layer over h (batch: ForwardBatch.flat()). The compiled unit (compile_policy): the model is an
    argument, so what is compiled and saved serves any instance of the same shapes (precompile)."""
    compiling = torch.compiler.is_compiling()  # the model's one question; the answer travels in ForwardBatch.compiled
    if compiling:
        batch = compile_policy.unaliased(batch)
    fb = _with_derived(model, ForwardBatch.from_flat(batch))
    if not compiling:
        for layer in model.layers:
            h = layer.forward(h, fb)
        return h
    batch = fb.flat()
    for layer in model.layers:
        h = _decoder_layer(layer, h, *batch)
    return h


def layer_by_layer(model: CausalLM, compiled_layer, h: torch.Tensor, fb: ForwardBatch, mark_dynamic) -> torch.Tensor:
    """Every decoder layer over h, each a call of `compiled_layer` (decoder_layer compiled as a frame of its own:
    core.compiled_stack.compile_each_layer); `mark_dynamic(h, fb)` marks the frame's step-varying dims, the derived
    LoRA fields' too."""
    fb = _with_derived(model, fb)
    mark_dynamic(h, fb)
    batch = fb.flat()
    for layer in model.layers:
        h = compiled_layer(layer, h, *batch)
    return h


def _with_derived(model: CausalLM, fb: ForwardBatch) -> ForwardBatch:
    """fb with what the model's LoRA kernel (LoRABatch.derive) and prefill attention (AttentionMetadata
    .derive_prefill) read derived on the device: once per step, not per layer, since every layer reads the same."""
    if model.lora_kernel in compile_policy.GEMM_KERNELS and fb.lora.weight_indices is not None:
        fb.lora = fb.lora.derive(model.lora_kernel, model.layers[0].mlp.down_proj.max_loras + 1)
    attn = model.layers[0].self_attn
    if model.prefill_backend == "sdpa" and not model.sliding:
        float32 = compile_policy.prefill_attention_float32(attn.k_cache.device, torch.compiler.is_compiling())
        dtype = torch.float32 if float32 else model.dtype
        fb.attn = fb.attn.derive_prefill(attn.n_heads // attn.n_kv, attn.k_cache.shape[1], dtype)
    return fb


_SLOT_BUFFERS = ("lora_a_stack", "lora_b", "dora_scale")  # a LoRALinear's per-slot constants


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, dtype, device, lora_kernel: str = "indexed",
                 attention_backend: str = "inductor", forms: list[dict[str, quantization.WeightForm]] | None = None,
                 head_form: quantization.WeightForm = quantization.NONE,
                 embed_form: quantization.WeightForm = quantization.NONE, prefill_backend: str | None = None):
        super().__init__()
        self.config = cfg
        # Each layer's path -> quantization.WeightForm (quantization.plan; part of the saved stack's key).
        self.weight_forms = [dict(f) for f in forms] if forms else [{} for _ in range(cfg.num_hidden_layers)]
        self.lora_kernel = lora_kernel  # compile_policy.lora_kernel: indexed, indexed+grouped, grouped, masked, ...
        # Steps of at least this many tokens take the grouped kernel instead (0: never; lora_grouped_prefill).
        self.lora_grouped_from = (compile_policy.LORA_GROUPED_MIN_TOKENS
                                  if compile_policy.lora_grouped_prefill(lora_kernel) else 0)
        self.attention_backend = attention_backend  # compile_policy.attention_backend: "inductor" or "sdpa"
        self.prefill_backend = prefill_backend or attention_backend  # compile_policy.prefill_attention_backend
        self.dtype = dtype
        # The embeddings at full width, or kept as a GGUF's blocks (quantization.table_form): rows widened on lookup.
        self.embed_form = embed_form
        if embed_form.kind != "none":
            self.embed_tokens = quantization.QuantizedEmbedding(cfg.vocab_size, cfg.hidden_size, embed_form.kind,
                                                                embed_form.group_size, dtype, device)
        else:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
            self.embed_tokens.weight.requires_grad_(False)
        # Gemma: sqrt(hidden_size) rounded to the embeddings' dtype first, as transformers multiplies them.
        self.embed_scale = (torch.tensor(cfg.hidden_size ** 0.5).to(dtype).item() if cfg.family.embed_scale
                            else None)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, max_loras, max_rank, dtype, device, lora_kernel, i, attention_backend,
                         self.weight_forms[i], self.prefill_backend)
            for i in range(cfg.num_hidden_layers)
        )
        # Whether some layer attends within a window (its prefill mask is its own, not the step's).
        self.sliding = any(cfg.is_sliding(i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, cfg.family.norm_offset)
        # The head at full width (tied: the embeddings), or, where quantization.table_form keeps a GGUF's blocks,
        # as packed codes and scales instead (head_qweight, head_qscales; tied: beside the embeddings).
        self.head_form = head_form
        self.lm_head = (
            None if head_form.kind != "none"
            else self.embed_tokens.weight if cfg.tie_word_embeddings
            else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False)
        )
        self.register_buffer("head_qweight", None, persistent=False)
        self.register_buffer("head_qscales", None, persistent=False)
        # The head's group size as a tensor, for the AMX template (quantization.amx_tiles), and the compiled
        # product that runs an AMX template for more than head_tiles_above() rows, where compiled_stack puts one
        # (head_tiles_usable).
        self.register_buffer("head_qgroup", None, persistent=False)
        self._head_tiles = None
        self.register_buffer("lm_head_packed", None, persistent=False)  # see prepack_weights
        self._run_layers = self.run_layers  # core.compiled_stack.compile_model swaps in the compiled stack

    def run_layers(self, h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        return layer_stack(self, h, *fb.flat())

    def hidden_states(self, input_ids: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """Every token's last hidden state: the part of a step a CUDA graph replays (cuda_graphs)."""
        h = self.embed_tokens(input_ids)
        return self._run_layers(h if self.embed_scale is None else h * self.embed_scale, fb)

    def logits(self, h: torch.Tensor, logits_idx: torch.Tensor) -> torch.Tensor:
        # Only the rows that are sampled go through the (large) vocabulary projection.
        x = self.norm(h[logits_idx])
        if self._head_tiles is not None and x.shape[0] > self.head_tiles_above():
            logits = self._head_tiles(x)
        elif self.head_qweight is not None:
            logits = quantization.kernel_linear(x, self.head_form.kind, self.head_qweight, self.head_qscales,
                                                self.head_form.group_size)
        else:
            logits = linear(x, self.lm_head, self.lm_head_packed)
        cap = self.config.final_logit_softcapping
        return (logits if cap is None else torch.tanh(logits / cap) * cap).float()

    def forward(self, input_ids: torch.Tensor, fb: ForwardBatch, logits_idx: torch.Tensor) -> torch.Tensor:
        return self.logits(self.hidden_states(input_ids, fb), logits_idx)

    def head_tiles_usable(self) -> bool:
        """Whether the quantized head can take an AMX template (amx_tiles.usable; int8 a scale a row is held for
        one, amx_int8): a head of a 49,152-word vocabulary held as int8 groups (two int4 halves) cost 24 ms of a
        32-token demo step in torch's kernel, 4 rows a pass."""
        return self.head_qweight is not None and (self.head_qweight.dim() == 3 or quantization.amx_tiles.usable(
            self.head_qweight, self.head_qscales, self.head_form.group_size, self.dtype))

    def head_tiles_above(self) -> int:
        """The rows above which the head takes its compiled template: any for int8 a scale a row (held in the
        template's layout only), else more than TILES_MIN_TOKENS (fewer keep torch's int4 kernel)."""
        return 0 if self.head_qweight.dim() == 3 else quantization.amx_tiles.TILES_MIN_TOKENS

    def head_tiles_product(self, x: torch.Tensor) -> torch.Tensor:
        """The quantized head's product through the AMX template (x's last row padding, left out: compile_head
        adds it, so that a single sampled row is not a row count of 1, which a compiled frame specialises):
        compiled by compiled_stack (where usable)."""
        if self.head_qweight.dim() == 3:
            return quantization.linear(x, "int8", self.head_qweight, self.head_qscales, 0, padding_rows=1)
        return quantization.tiles_linear(x, self.head_form.kind, self.head_qweight, self.head_qscales,
                                         self.head_form.group_size, self.head_qgroup, padding_rows=1)

    def memory_bytes(self) -> dict[str, int]:
        """What the model holds, by kind, for the start log: "weights" (one copy of each base weight, in its form),
        "packed" (oneDNN's second copies, prepack_weights), "adapters" (the device slots' constants); the KV cache apart."""
        held = {"weights": 0, "packed": 0, "adapters": 0}
        seen: set[int] = set()  # (a tied head is the embeddings' tensor)
        for name, t in [*self.named_parameters(), *self.named_buffers()]:
            leaf = name.rpartition(".")[2]
            # (weight_stacked holds a projection's weight and its slots' A, each counted as itself)
            if t is None or id(t) in seen or leaf in ("k_cache", "v_cache", "weight_stacked"):
                continue
            seen.add(id(t))
            kind = ("packed" if leaf in ("weight_packed", "lm_head_packed")
                    else "adapters" if leaf in _SLOT_BUFFERS else "weights")
            held[kind] += t.numel() * t.element_size()
        return held

    @torch.no_grad()
    def prepack_weights(self) -> None:
        """Give every base projection and the head a oneDNN-packed copy (CPU float32; see packed_gemm).
        Costs a second copy of those weights in memory."""
        for module in self.modules():
            if isinstance(module, LoRALinear):
                module.prepack()
        if self.head_qweight is None:
            self.lm_head_packed = packed_gemm.prepack(self.lm_head)

    @torch.no_grad()
    def load_weights(self, ckpt: SafetensorsCheckpoint) -> None:
        """Copy every tensor from the checkpoint into place, packing modules as the family's table says."""
        def put(dst: torch.Tensor, name: str) -> None:
            dst.copy_(ckpt.get(name, tuple(dst.shape)))

        shape = (self.config.vocab_size, self.config.hidden_size)
        if self.embed_form.kind != "none":
            self.embed_tokens.load(quantization.load(ckpt, "model.embed_tokens.weight", shape, self.embed_form))
        else:
            put(self.embed_tokens.weight, "model.embed_tokens.weight")
        put(self.norm.weight, "model.norm.weight")
        if self.head_form.kind != "none":
            name = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
            self.head_qweight, self.head_qscales = quantization.pack(
                quantization.load(ckpt, name, shape, self.head_form), self.dtype, self.norm.weight.device)
            self.head_qgroup = torch.tensor(self.head_form.group_size, device=self.norm.weight.device)
        elif not self.config.tie_word_embeddings:
            put(self.lm_head, "lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            for name, norm in layer.named_modules():  # the norms are named as in the checkpoint
                if isinstance(norm, RMSNorm):
                    put(norm.weight, f"{p}{name}.weight")
            paths = lora_targets(self.config)
            for projection, modules in layer.projections():
                if projection.weight is None:  # kept quantized (lora_compile/model/quantization/): its modules' rows, then packed
                    form = quantization.WeightForm(projection.quant, projection.group_size)
                    parts = [quantization.load(ckpt, f"{p}{paths[m]}.weight", (end - start, projection.in_features),
                                               form) for (start, end), m in zip(projection._slices, modules)]
                    projection.load_quantized(quantization.cat_rows(parts))
                for (start, end), module in zip(projection._slices, modules):
                    if projection.weight is not None:
                        put(projection.weight[start:end], f"{p}{paths[module]}.weight")
                    if projection.bias is not None:
                        put(projection.bias[start:end], f"{p}{paths[module]}.bias")
