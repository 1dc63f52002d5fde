"""The model with its weights, in the forms the quantization plan chose (model/quantization decides; this builds),
and the start log's lines about them: each tensor type's form, then the bytes held."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..host_memory import release_free_heap
from ..config import EngineConfig
from ..model import packed_gemm, quantization
from ..model.causal_lm import CausalLM, projection_tensors
from ..model.loader.source import ModelSource

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: CausalLM
    quantized: bool  # some projection keeps a quantized form (no float weight to merge an adapter into)


def load_model(config: EngineConfig, source: ModelSource, device: torch.device, dtype: torch.dtype,
               lora_kernel: str, attention_backend: str, prefill_backend: str) -> LoadedModel:
    mc = source.config
    with source.open_checkpoint() as ckpt:
        forms, described = quantization.plan(config.quantization, config.quantization_group_size, ckpt,
                                             *projection_tensors(mc), device, dtype)
        embed, tied = "model.embed_tokens.weight", mc.tie_word_embeddings
        table = (mc.vocab_size, mc.hidden_size)
        embed_form, embed_lines = quantization.table_form(config.quantization, ckpt, embed, "embeddings", table,
                                                          device, dtype)
        head_form, head_lines = quantization.table_form(
            config.quantization, ckpt, embed if tied else "lm_head.weight", "head (tied)" if tied else "head",
            table, device, dtype, config.compile)
        for line in described + embed_lines + head_lines:
            log.info("weights %s", line)
        model = CausalLM(mc, config.max_loras_per_batch, config.max_lora_rank, dtype, device, lora_kernel,
                         attention_backend, forms, head_form, embed_form, prefill_backend)
        model.load_weights(ckpt)
    release_free_heap()  # (loading's temporaries: docs/operations.md, quantized weights)
    if config.prepack_weights and packed_gemm.available(device, dtype):
        model.prepack_weights()
    quantized = any(form.kind != "none" for layer in forms for form in layer.values())
    return LoadedModel(model, quantized)
