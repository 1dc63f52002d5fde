"""The grouped LoRA kernel (layers._lora_delta_grouped: tokens sorted by slot, grouped GEMMs over per-slot segments
whose ends stay on the device), checked on the CPU through torch's own grouped_mm: the layer against the per-adapter
GEMMs, and the engine token for token against transformers + peft. Compiled (bfloat16 only: torch's grouped_mm
compiles for no other dtype), it is CUDA's default form, checked by tests/test_cuda.py on the GPU."""
from __future__ import annotations

import pytest
import torch

from lora_compile import compile_policy
from lora_compile.forward_batch import LoRABatch
from lora_compile.layers import LoRALinear, _lora_delta_grouped, _lora_delta_segmented
from tests.conftest import build_engine
from tests.test_engine_golden import PROMPTS, assert_matches_reference, run_joining
from tests.test_lora import MIXED

JOIN_AT = [0, 0, 1, 2]


def _layer(max_loras: int, rank: int, dtype=torch.float32) -> LoRALinear:
    torch.manual_seed(0)
    layer = LoRALinear(32, (24, 8, 8), False, max_loras, rank, dtype, torch.device("cpu"))
    layer.weight.normal_()
    for slot in range(1, max_loras + 1):
        r = rank if slot % 2 else rank // 2  # mixed ranks: the rest of a slot's rows stay zero
        layer.load_slot(slot, [(torch.randn(r, 32), torch.randn(size, r)) if slot != 2 or i != 1 else None
                               for i, size in enumerate(layer.output_sizes)])
    return layer


@pytest.mark.parametrize("indices", [
    [3, 0, 1, 3, 1, 0, 2, 3],    # unsorted, base-model tokens among them
    [2, 2, 2, 2],                # one adapter, every other segment empty
    [0, 0, 4, 1],                # slots at both ends, empty ones between
], ids=["mixed", "one", "sparse"])
def test_grouped_layer_equals_per_adapter_gemms(indices):
    """Each token's delta is its own slot's B·A·x whatever the order and mix: the grouped form against one GEMM
    pair per adapter (the eager form), float32; a base-model token's delta is exactly zero."""
    layer = _layer(max_loras=4, rank=8)
    x = torch.randn(len(indices), 32)
    idx = torch.tensor(indices)
    lora = LoRABatch(idx).segments(layer.max_loras + 1)
    assert lora.segment_offsets.tolist() == torch.bincount(idx, minlength=5).cumsum(0).tolist()
    assert torch.equal(idx[lora.token_order], idx.sort(stable=True).values)
    grouped = _lora_delta_grouped(layer, x, lora)
    reference = _lora_delta_segmented(layer, x, idx)
    assert reference.abs().max() > 1  # the adapters change something
    torch.testing.assert_close(grouped, reference, atol=1e-5, rtol=1e-5)
    assert (grouped[idx == 0] == 0).all()


def test_kernel_policy():
    cpu, bf16, f32 = torch.device("cpu"), torch.bfloat16, torch.float32
    assert compile_policy.lora_kernel("auto", cpu, bf16, 16, compiled=True) == "indexed"  # the CPU's form
    assert compile_policy.lora_kernel("grouped", cpu, f32, 16, compiled=False) == "grouped"
    assert compile_policy.lora_kernel("grouped", cpu, bf16, 16, compiled=True) == "grouped"
    with pytest.raises(ValueError, match="bfloat16"):
        compile_policy.lora_kernel("grouped", cpu, f32, 16, compiled=True)
    with pytest.raises(ValueError, match="multiples of 8"):
        compile_policy.lora_kernel("grouped", cpu, bf16, 12, compiled=False)


def test_grouped_engine_matches_peft(models, adapters):
    """The engine with the grouped kernel (eager, float32), a batch mixing the base model and three adapters of
    ranks 4-16 joining at different steps: exactly transformers + peft's greedy tokens, close logits."""
    engine = build_engine(models["llama"], adapters["llama"], compile=False, lora_kernel="grouped")
    assert engine.model.lora_kernel == "grouped"
    tokens, logits = run_joining(engine, PROMPTS, adapters=MIXED, join_at=JOIN_AT)
    assert_matches_reference(models["llama"], PROMPTS, tokens, logits,
                             [adapters["llama"][n] if n else None for n in MIXED])
