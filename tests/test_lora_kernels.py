"""The CUDA LoRA kernels, checked on the CPU: "grouped" (layers._lora_delta_grouped: tokens sorted by slot, grouped
GEMMs over per-slot segments whose ends stay on the device; through torch's own grouped_mm, eagerly: it compiles for
bfloat16 only) and "masked" (layers._lora_delta_masked: GEMMs over every slot, each token's own kept), each layer
against the per-adapter GEMMs and each engine token for token against transformers + peft. tests/test_cuda.py runs
them compiled on the GPU."""
from __future__ import annotations

import pytest
import torch

from lora_compile import compile_policy
from lora_compile.model.forward_batch import LoRABatch
from lora_compile.model.layers import LoRALinear, _lora_delta_grouped, _lora_delta_masked, _lora_delta_segmented
from tests.conftest import build_engine
from tests.test_engine_golden import PROMPTS, assert_matches_reference, run_joining
from tests.test_lora import MIXED

JOIN_AT = [0, 0, 1, 2]


def _layer(max_loras: int, rank: int, block_diagonal_b: bool, b_chunk: int = 0) -> LoRALinear:
    torch.manual_seed(0)
    layer = LoRALinear(32, (24, 8, 8), False, max_loras, rank, torch.float32, torch.device("cpu"),
                       block_diagonal_b=block_diagonal_b, b_chunk=b_chunk)
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
def test_kernels_equal_per_adapter_gemms(indices):
    """Each token's delta is its own slot's B·A·x whatever the order and mix: the grouped and masked forms (on the
    block-diagonal B) against one GEMM pair per adapter (the eager form, on the compact B), float32; a base-model
    token's delta is exactly zero."""
    compact, block = _layer(4, 8, block_diagonal_b=False), _layer(4, 8, block_diagonal_b=True)
    torch.testing.assert_close(compact.merged_weight(3), block.merged_weight(3))  # same adapters, other layout
    x = torch.randn(len(indices), 32)
    idx = torch.tensor(indices)
    reference = _lora_delta_segmented(compact, x, idx)
    assert reference.abs().max() > 1  # the adapters change something
    torch.testing.assert_close(_lora_delta_segmented(block, x, idx), reference, atol=1e-5, rtol=1e-5)
    lora = LoRABatch(idx).derive("grouped", block.max_loras + 1)
    assert lora.segment_offsets.tolist() == torch.bincount(idx, minlength=5).cumsum(0).tolist()
    assert torch.equal(idx[lora.token_order], idx.sort(stable=True).values)
    masks = LoRABatch(idx).derive("masked", block.max_loras + 1).slot_mask
    assert masks.sum(1).eq(1).all() and masks.int().argmax(1).tolist() == indices
    # The CPU's long steps (INDEXED_GROUPED): the grouped shrink over the compact B's layer, then the expand
    # grouped per output slice compiled (B compact, or chunk-major as in bfloat16), per adapter eager.
    chunked = _layer(4, 8, block_diagonal_b=False, b_chunk=8)
    grouped_shrinks = [_lora_delta_grouped(layer, x, lora, compiled)
                       for layer, compiled in ((compact, True), (chunked, True), (compact, False))]
    for delta in (_lora_delta_grouped(block, x, lora), _lora_delta_masked(block, x, masks), *grouped_shrinks):
        torch.testing.assert_close(delta, reference, atol=1e-5, rtol=1e-5)
        assert (delta[idx == 0] == 0).all()


def test_masked_kernel_isolates_an_overflowing_slot():
    """Another slot's shrink overflowing to inf leaves a token's delta finite: the mask replaces it, never
    multiplies it (0 x inf would be NaN)."""
    layer = _layer(4, 8, block_diagonal_b=True)
    layer.lora_a_stack[2].fill_(3e38)
    x = torch.ones(3, 32)
    idx = torch.tensor([1, 2, 3])
    delta = _lora_delta_masked(layer, x, LoRABatch(idx).derive("masked", 5).slot_mask)
    assert delta[[0, 2]].isfinite().all() and not delta[1].isfinite().all()


def test_kernel_policy():
    cpu, bf16, f32 = torch.device("cpu"), torch.bfloat16, torch.float32
    # The CPU's form: indexed, with long steps grouped in bfloat16 (ranks in multiples of 8); by name, indexed only.
    assert compile_policy.lora_kernel("auto", cpu, bf16, 16, compiled=True) == compile_policy.INDEXED_GROUPED
    assert compile_policy.lora_kernel("auto", cpu, bf16, 12, compiled=True) == "indexed"
    assert compile_policy.lora_kernel("auto", cpu, f32, 16, compiled=True) == "indexed"
    assert compile_policy.lora_kernel("indexed", cpu, bf16, 16, compiled=True) == "indexed"
    assert compile_policy.lora_kernel("grouped", cpu, f32, 16, compiled=False) == "grouped"
    assert compile_policy.lora_kernel("grouped", cpu, bf16, 16, compiled=True) == "grouped"
    with pytest.raises(ValueError, match="bfloat16"):
        compile_policy.lora_kernel("grouped", cpu, f32, 16, compiled=True)
    with pytest.raises(ValueError, match="multiples of 8"):
        compile_policy.lora_kernel("grouped", cpu, bf16, 12, compiled=False)
    assert compile_policy.lora_kernel("masked", cpu, f32, 12, compiled=True) == "masked"  # plain GEMMs: anywhere
    # B chunk-major for the CPU's indexed kernel in bfloat16 only, where every slice divides into chunks.
    sizes, chunk = (576, 192, 192), compile_policy.LORA_B_CHUNK
    assert compile_policy.lora_b_chunk("indexed", cpu, bf16, sizes) == chunk
    assert compile_policy.lora_b_chunk(compile_policy.INDEXED_GROUPED, cpu, bf16, sizes) == chunk
    assert compile_policy.lora_b_chunk("indexed", cpu, f32, sizes) == 0
    assert compile_policy.lora_b_chunk("indexed", cpu, bf16, (576, 200, 200)) == 0
    assert compile_policy.lora_b_chunk("indexed", torch.device("cuda"), bf16, sizes) == 0
    assert compile_policy.lora_b_chunk("masked", cpu, bf16, sizes) == 0


def test_attention_backend_policy():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compile_policy.attention_backend("auto", cpu, None) == "inductor"  # the CPU's measured reductions
    assert compile_policy.attention_backend("auto", cuda, None) == "sdpa"
    assert compile_policy.attention_backend("auto", cuda, 50.0) == "inductor"  # soft-capped scores: no SDPA form
    assert compile_policy.attention_backend("sdpa", cpu, None) == "sdpa"  # asked for: any device
    with pytest.raises(ValueError, match="soft-cap"):
        compile_policy.attention_backend("sdpa", cuda, 50.0)
    # prompt chunks: torch's fused attention on every device unless soft-capped or asked otherwise
    assert compile_policy.prefill_attention_backend("auto", None) == "sdpa"
    assert compile_policy.prefill_attention_backend("auto", 50.0) == "inductor"
    assert compile_policy.prefill_attention_backend("inductor", None) == "inductor"


@pytest.mark.parametrize("kernel", ["grouped", "masked"])
def test_engine_matches_peft(models, adapters, kernel):
    """The engine with each kernel (eager, float32), a batch mixing the base model and three adapters of ranks
    4-16 joining at different steps: exactly transformers + peft's greedy tokens, close logits."""
    engine = build_engine(models["llama"], adapters["llama"], compile=False, lora_kernel=kernel)
    assert engine.model.lora_kernel == kernel
    tokens, logits = run_joining(engine, PROMPTS, adapters=MIXED, join_at=JOIN_AT)
    assert_matches_reference(models["llama"], PROMPTS, tokens, logits,
                             [adapters["llama"][n] if n else None for n in MIXED])
