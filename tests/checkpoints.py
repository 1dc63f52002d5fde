"""Tiny deterministic checkpoints and adapters for tests, and transformers/peft as the reference.

Only tests import this module: it needs transformers and peft, which the runtime does not.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config,
                          PretrainedConfig, Qwen2Config, Qwen3Config)

from lora_serve_demo import BOS_ID, EOS_ID, VOCAB_SIZE, write_demo_tokenizer

_CONFIGS: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig, "qwen3": Qwen3Config, "phi3": Phi3Config,
    "gemma2": Gemma2Config, "gemma3": Gemma3TextConfig,
}
SLIDING_WINDOW = 8  # Gemma's tiny window: prompts and generations of tests run well past it
# Each family's own features, switched on at a size where they change the tokens of a test's lengths.
_FAMILY_CONFIG: dict[str, dict] = {
    "qwen3": dict(head_dim=32),  # q/k norms over a head_dim that is not hidden / heads
    "phi3": dict(
        # Short factors throughout a test (transformers recomputes a sequence's cache with the long ones once it
        # passes original_max_position_embeddings; the engine does not: see test_longrope_tables_match_transformers).
        pad_token_id=None, partial_rotary_factor=0.5, original_max_position_embeddings=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "short_factor": [1.0, 1.3, 2.1, 3.0], "long_factor": [1.5, 2.5, 4.0, 6.0]}),
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=SLIDING_WINDOW, attn_logit_softcapping=4.0,
                   final_logit_softcapping=6.0),  # layer_types: sliding, full
    "gemma3": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=SLIDING_WINDOW,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
}
# PEFT's names for every LoRA-able projection of a family's layer.
ALL_TARGETS = {"phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
UNFUSED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TINY_HIDDEN = 64
SHARD_SIZE = "200KB"  # a 2-layer tiny model is ~0.6 MB: this gives several shards


def _tiny_config(arch: str, *, tie_word_embeddings: bool, dtype: str, rope_scaling: dict | None,
                 num_layers: int) -> PretrainedConfig:
    if arch not in _CONFIGS:
        raise ValueError(f"arch must be one of {sorted(_CONFIGS)}, got {arch!r}")
    # transformers 5 keeps rope_theta and the scaling together in rope_parameters.
    rope = {"rope_type": "default", "rope_theta": 10000.0} | (rope_scaling or {})
    common = dict(
        vocab_size=VOCAB_SIZE,  # the demo tokenizer is copied in
        hidden_size=TINY_HIDDEN,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_parameters=rope,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        dtype=dtype,
    )
    return _CONFIGS[arch](**(common | _FAMILY_CONFIG.get(arch, {})))


def _init_std(name: str, param: torch.Tensor) -> float:
    """Scales found by a small sweep so greedy decoding wanders instead of repeating a token, as it does
    with transformers' init (std 0.02) at this size: sharper attention (q, k) and a strong MLP make the
    residual depend on the context; small embeddings keep a tied lm_head from echoing the input token."""
    if name.endswith(".bias"):
        return 0.1  # Qwen2's qkv bias; larger v biases push every position towards the same tokens
    if "embed_tokens" in name:
        return 0.3
    if name.startswith("lm_head"):
        return 0.4
    gain = 2.0 if any(m in name for m in ("q_proj", "k_proj", "qkv_proj", "mlp.")) else 1.0
    return gain * param.shape[1] ** -0.5


@torch.no_grad()
def _init_weights(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():  # tied lm_head is not listed again: it is embed_tokens
        noise = torch.randn(param.shape, generator=gen)
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.1 * noise)  # not all ones, so a norm that is not loaded shows up
        else:
            param.copy_(noise * _init_std(name, param))


def make_tiny_model(out_dir: str | os.PathLike, arch: str = "llama", *, seed: int = 0,
                    tie_word_embeddings: bool = False, dtype: str = "float32", rope_scaling: dict | None = None,
                    num_layers: int = 2, sharded: bool = False) -> Path:
    """A tiny random `arch` checkpoint (safetensors, optionally sharded) with the demo tokenizer."""
    config = _tiny_config(arch, tie_word_embeddings=tie_word_embeddings, dtype=dtype,
                          rope_scaling=rope_scaling, num_layers=num_layers)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, seed)
    model.to(_DTYPES[dtype])
    out = Path(out_dir)
    # transformers 5 always writes safetensors (save_pretrained has no safe_serialization any more).
    model.save_pretrained(out, max_shard_size=SHARD_SIZE if sharded else "1GB")
    write_demo_tokenizer(out)
    return out


def _lora_scaling(r: int, lora_alpha: float, use_rslora: bool) -> float:
    return lora_alpha / (r**0.5 if use_rslora else r)


def make_peft_adapter(base_dir: str | os.PathLike, out_dir: str | os.PathLike, *, r: int = 8, lora_alpha: int = 16,
                      target_modules: Sequence[str] = ("q_proj", "v_proj"), use_rslora: bool = False, seed: int = 1,
                      scale: float = 0.5, use_dora: bool = False,
                      alora_invocation_tokens: Sequence[int] | None = None) -> Path:
    """A PEFT LoRA adapter for `base_dir`, saved by peft itself.

    `scale` is the size of the LoRA update relative to the base layer's output (for unit-RMS inputs),
    whatever r and alpha are: A ~ N(0, 1/in), B ~ N(0, scale² / (r · scaling²)). `use_dora`: a DoRA adapter, each
    output's magnitude PEFT's initial one times U(0.5, 1.5), so that rescaling matters. `alora_invocation_tokens`: an
    activated LoRA, acting from the last occurrence of those ids in a prompt on.
    """
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules), use_rslora=use_rslora,
                        init_lora_weights=False, task_type="CAUSAL_LM", use_dora=use_dora,
                        alora_invocation_tokens=list(alora_invocation_tokens) if alora_invocation_tokens else None)
    peft_model = get_peft_model(model, config)
    b_std = scale / (r**0.5 * _lora_scaling(r, lora_alpha, use_rslora))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_A." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * param.shape[1] ** -0.5)
            elif ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * b_std)
            elif ".lora_magnitude_vector." in name:
                param.mul_(torch.rand(param.shape, generator=gen) + 0.5)
    out = Path(out_dir)
    peft_model.save_pretrained(out, safe_serialization=True)
    return out


def load_reference(model_dir: str | os.PathLike, adapter_dir: str | os.PathLike | None = None,
                   dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.nn.Module:
    """transformers (+ peft) with eager attention, float32 on the CPU unless told: the numerics the engine is
    compared with."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager").to(device)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


@torch.no_grad()
def reference_greedy(model_dir: str | os.PathLike, prompt_ids: Sequence[int], max_new_tokens: int,
                     adapter_dir: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32,
                     device: str = "cpu") -> tuple[list[int], torch.Tensor]:
    """Greedy tokens (exactly max_new_tokens: EOS does not stop) and the raw logits of each step, (steps, vocab),
    on the CPU."""
    return greedy(load_reference(model_dir, adapter_dir, dtype, device), prompt_ids, max_new_tokens)


@torch.no_grad()
def greedy(model: torch.nn.Module, prompt_ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """reference_greedy's tokens and logits from a model already loaded."""
    ids = torch.tensor([list(prompt_ids)], device=model.device)
    # eos_token_id=None must be a keyword: a GenerationConfig(eos_token_id=None) is merged with the model's
    # generation_config.json and still stops at EOS. min_new_tokens would instead mask EOS in the scores.
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=None, return_dict_in_generate=True, output_logits=True)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    assert len(tokens) == max_new_tokens, f"generate stopped early: {len(tokens)} of {max_new_tokens} tokens"
    return tokens, torch.cat(out.logits, dim=0).float().cpu()


def write_chat_template(model_dir: str | os.PathLike, template: str) -> None:
    """Give a checkpoint a chat template, where transformers keeps it (tokenizer_config.json)."""
    path = Path(model_dir) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    path.write_text(json.dumps(config, indent=2))


_PROJECTION_WEIGHT = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight")


def dequantised_checkpoint(model_dir: str | os.PathLike, out_dir: str | os.PathLike, kind: str,
                           group_size: int = 32) -> Path:
    """`model_dir`'s checkpoint with every projection weight replaced by what `--quantization kind` holds of it,
    dequantised (quantization.quantize_int4 / quantize_int8 at load, then QuantizedTensor.dequantize): the reference
    a quantized engine is compared with. Other tensors, config and tokenizer as they are."""
    from safetensors.torch import load_file, save_file

    from lora_compile.model.quantization import quantize_int4, quantize_int8

    src, out = Path(model_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state: dict[str, torch.Tensor] = {}
    for path in sorted(src.iterdir()):
        if path.suffix == ".safetensors":
            state |= load_file(path)
        elif path.is_file() and path.name != "model.safetensors.index.json":
            shutil.copy(path, out / path.name)
    for name, weight in state.items():
        if _PROJECTION_WEIGHT.fullmatch(name):
            qt = quantize_int4(weight, group_size) if kind == "int4" else quantize_int8(weight)
            state[name] = qt.dequantize().to(weight.dtype)
    save_file(state, str(out / "model.safetensors"))
    return out
