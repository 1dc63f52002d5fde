"""Quantized base weights on the GPU (`--quantization int8 / int4`): each CUDA weight form's product against the
dequantised product, and the whole engine against transformers + peft over the dequantised weights (float32 exactly,
as on the CPU in tests/test_quantized_reference.py; bfloat16 by tests/test_cuda.py's tie rule). Skipped without a
GPU."""
from __future__ import annotations

import pytest
import torch

from lora_compile.model import quantization as qz
from tests.checkpoints import dequantised_checkpoint, reference_greedy
from tests.test_cuda import JOIN_AT, _assert_bf16_agreement, cuda_engine, needs_cuda
from tests.test_engine_golden import NEW_TOKENS, PROMPTS, run_joining
from tests.test_lora import MIXED


@needs_cuda
@pytest.mark.parametrize("kind,group_size", [("int8", 0), ("int4", 32), ("int4", 128), ("int8", 32)],
                         ids=["int8-rows", "int4-g32", "int4-g128", "int8-groups"])
def test_cuda_quantized_products_within_bfloat16_of_the_dequantised_product(kind, group_size):
    """Each CUDA weight form (quantization.pack / linear: torch's int4 kernel, int8 a scale a row, int8 groups as two
    int4 halves) at decode and prefill row counts: within bfloat16's bound (2e-2 of the largest value, as on the
    CPU) of the product over the dequantised float32 weight."""
    gen = torch.Generator().manual_seed(5)
    n, k = 3072, 2048
    w = torch.randn(n, k, generator=gen) * 0.02
    if kind == "int4":
        qt = qz.quantize_int4(w, group_size)
    elif group_size:  # (a GGUF's int8 groups, w = q s + z: built directly, as no float weight is quantized so)
        codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        scale = torch.rand(n, k // group_size, generator=gen) * 1e-3 + 1e-4
        qt = qz.QuantizedTensor("int8", codes, scale, torch.randn(n, k // group_size, generator=gen) * 1e-3, group_size)
    else:
        qt = qz.quantize_int8(w)
    reference = qt.dequantize().cuda()
    codes, scales = qz.pack(qt, torch.bfloat16, torch.device("cuda"))
    for tokens in (1, 9, 33, 65, 512):
        x = torch.randn(tokens, k, generator=gen).cuda()
        expected = x @ reference.T
        got = qz.linear(x.bfloat16(), qt.kind, codes, scales, qt.group_size).float()
        error = ((got - expected).abs().max() / expected.abs().max()).item()
        assert error <= 2e-2, f"{kind} groups of {group_size}, {tokens} tokens: {error:.2e} off"


@needs_cuda
@pytest.mark.parametrize("kind,group_size,dtype", [("int8", 0, "float32"), ("int8", 0, "bfloat16"),
                                                   ("int4", 32, "bfloat16"), ("int4", 128, "bfloat16")],
                         ids=["int8-f32", "int8-bf16", "int4-g32-bf16", "int4-g128-bf16"])
def test_cuda_quantized_at_load_agrees_with_the_dequantised_reference(models, adapters, tmp_path, kind, group_size,
                                                                      dtype):
    """`--quantization int8 / int4` on the GPU, compiled, CUDA graphs, a batch mixing the base model and three
    adapters: in float32 exactly the greedy tokens of transformers + peft over the dequantised weights (as on the
    CPU: tests/test_quantized_reference.py); in bfloat16 (torch's CUDA int4 kernel computes in bfloat16 only) the
    bf16 agreement rule against that reference."""
    engine = cuda_engine(models["llama"], adapters["llama"], dtype=dtype, quantization=kind,
                         quantization_group_size=group_size or 32)
    assert engine.quantized and engine.model.layers[0].mlp.down_proj.weight is None
    reference_dir = dequantised_checkpoint(models["llama"], tmp_path / "dequantised", kind, group_size or 32)
    if dtype == "bfloat16":
        _assert_bf16_agreement(engine, reference_dir, adapters)
        return
    tokens, logits = run_joining(engine, PROMPTS, adapters=MIXED, join_at=JOIN_AT)
    for i, (prompt, name) in enumerate(zip(PROMPTS, MIXED)):
        adapter_dir = adapters["llama"][name] if name else None
        ref_tokens, ref_logits = reference_greedy(reference_dir, prompt, NEW_TOKENS, adapter_dir, device="cuda")
        assert tokens[i] == ref_tokens, f"sequence {i} (adapter {name}) differs from the dequantised reference"
        torch.testing.assert_close(logits[i].cpu(), ref_logits, atol=2e-3, rtol=1e-3)
