"""`--quantization int8 / int4` of a float checkpoint, the whole engine: a batch mixing the base model and three
adapters gives exactly the greedy tokens of transformers + peft over the dequantised weights (what the engine holds,
tests.checkpoints.dequantised_checkpoint), float32 on the CPU, and close logits. tests/test_cuda.py checks the same
on a GPU (int4 there in bfloat16 only, judged by the bf16 tie rule)."""
from __future__ import annotations

import pytest
import torch

from lora_compile import compile_policy
from lora_compile.model.quantization import NONE, WeightForm
from tests.checkpoints import dequantised_checkpoint, reference_greedy
from tests.conftest import build_engine
from tests.test_engine_golden import NEW_TOKENS, PROMPTS, run_joining
from tests.test_lora import MIXED

JOIN_AT = [0, 0, 1, 2]


@pytest.mark.parametrize("kind,group_size", [("int8", 0), ("int4", 32), ("int4", 64)],
                         ids=["int8-rows", "int4-g32", "int4-g64"])
def test_quantized_at_load_gives_the_dequantised_references_tokens(models, adapters, tmp_path, kind, group_size):
    engine = build_engine(models["llama"], adapters["llama"], compile=False, quantization=kind,
                          quantization_group_size=group_size or 32)
    assert engine.quantized
    projection = engine.model.layers[0].mlp.gate_up_proj
    assert projection.weight is None and (projection.quant, projection.group_size) == (kind, group_size)
    reference_dir = dequantised_checkpoint(models["llama"], tmp_path / "dequantised", kind, group_size or 32)
    tokens, logits = run_joining(engine, PROMPTS, adapters=MIXED, join_at=JOIN_AT)
    differs_from_full_width = False
    for i, (prompt, name) in enumerate(zip(PROMPTS, MIXED)):
        adapter_dir = adapters["llama"][name] if name else None
        ref_tokens, ref_logits = reference_greedy(reference_dir, prompt, NEW_TOKENS, adapter_dir)
        assert len(set(ref_tokens)) > 4, "degenerate reference: the test would prove nothing"
        assert tokens[i] == ref_tokens, f"sequence {i} (adapter {name}) differs from the dequantised reference"
        torch.testing.assert_close(logits[i], ref_logits, atol=2e-3, rtol=1e-3)
        full_tokens, _ = reference_greedy(models["llama"], prompt, NEW_TOKENS, adapter_dir)
        differs_from_full_width |= full_tokens != ref_tokens
    # (int4 moves the tiny model's tokens: the reference is the quantized weights', not the float checkpoint's)
    assert differs_from_full_width or kind == "int8"


def test_int8_rows_on_cuda_autotune_the_stacks_gemms():
    """compile_policy.inductor_options: autotuned GEMMs (whose Triton templates widen int8 codes in their prologue)
    only on CUDA, and only where a projection holds int8 codes a scale a row; elsewhere Inductor's defaults."""
    rows, groups, int4 = (WeightForm("int8", 0), WeightForm("int8", 32), WeightForm("int4", 32))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert compile_policy.inductor_options(cuda, [{"mlp.down_proj": NONE}, {"mlp.down_proj": rows}]) == {
        "max_autotune_gemm": True}
    assert compile_policy.inductor_options(cpu, [{"mlp.down_proj": rows}]) == {}
    assert compile_policy.inductor_options(cuda, [{"mlp.down_proj": groups, "self_attn.o_proj": int4}]) == {}
    assert compile_policy.inductor_options(cuda, [{}]) == {}
