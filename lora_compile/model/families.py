"""The decoder families the engine serves, and what differs between them, declared in one place.

vLLM writes one model file per family; here every family runs the one decoder of model.py, which reads these
fields (and the typed ModelConfig fields they select from config.json) instead of asking for an architecture.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, Mapping

# A decoder layer's projections (vLLM's packed_modules_mapping, plus where each lives): the checkpoint's (and
# PEFT's) modules that each one packs along its outputs, in order.
UNFUSED: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
})
# Checkpoints that store q/k/v and gate/up already packed (Phi-3): one module each, so a LoRA on it is one A and
# one B over all the packed outputs, where q/k/v LoRAs are one per slice.
FUSED: Mapping[str, tuple[str, ...]] = MappingProxyType({path: (path.split(".")[1],) for path in UNFUSED})

# Which layers of an older config.json (no `layer_types`) attend through `sliding_window`: "all" of them
# (Mistral), every second one from the first (Gemma 2), or all but every `sliding_window_pattern`-th (Gemma 3).
SlidingPattern = Literal["all", "alternate", "pattern"]


@dataclass(frozen=True)
class Family:
    projections: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: UNFUSED)
    qkv_bias: bool | None = None      # q/k/v biases whatever attention_bias says (Qwen2: always); None: the config's
    o_proj_bias: bool | None = None   # likewise for o_proj (Qwen2, Phi-3: never)
    qk_norm: bool = False             # an RMSNorm over each head of q and k, before rotary (Qwen3, Gemma 3)
    norm_offset: float = 0.0          # RMSNorms scale by (offset + w) in float32 (Gemma stores w around 0)
    sandwich_norms: bool = False      # norms after attention and the MLP too, and before the MLP (Gemma 2 / 3)
    embed_scale: bool = False         # embeddings times sqrt(hidden_size), rounded to their dtype (Gemma)
    activation_key: str = "hidden_act"  # the config key naming the MLP's activation
    sliding_pattern: SlidingPattern = "all"
    local_rope: bool = False          # sliding layers rotate with their own base (Gemma 3's rope_local_base_freq)
    # transformers' defaults for keys a config.json may leave out (its config class writes only what differs).
    defaults: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))

    def lora_targets(self) -> dict[str, str]:
        """Modules a LoRA adapter may target (PEFT's names, in layer order) -> their path in a decoder layer."""
        return {m: f"{path.split('.')[0]}.{m}" for path, modules in self.projections.items() for m in modules}


_GEMMA = dict(norm_offset=1.0, sandwich_norms=True, embed_scale=True, activation_key="hidden_activation")
FAMILIES: Mapping[str, Family] = MappingProxyType({
    "LlamaForCausalLM": Family(),
    "MistralForCausalLM": Family(),
    "Qwen2ForCausalLM": Family(qkv_bias=True, o_proj_bias=False),
    "Qwen3ForCausalLM": Family(qk_norm=True),
    "Phi3ForCausalLM": Family(projections=FUSED, qkv_bias=False, o_proj_bias=False),
    "Gemma2ForCausalLM": Family(**_GEMMA, sliding_pattern="alternate", defaults=MappingProxyType({
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0, "tie_word_embeddings": True})),
    "Gemma3ForCausalLM": Family(**_GEMMA, qk_norm=True, sliding_pattern="pattern", local_rope=True,
                                defaults=MappingProxyType({
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6, "tie_word_embeddings": True})),
})
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
# The table of the families most checkpoints and adapters use (Llama's); model.py exports it for the demo.
LORA_TARGETS = FAMILIES["LlamaForCausalLM"].lora_targets()
