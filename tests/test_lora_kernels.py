"""The CUDA LoRA kernels, checked on the CPU: "grouped" (lora_deltas.grouped: tokens sorted by slot, grouped
GEMMs over per-slot segments whose ends stay on the device; through torch's own grouped_mm, eagerly: it compiles for
bfloat16 only), "masked" (lora_deltas.masked: GEMMs over every slot, each token's own kept), "gathered" and
"stacked" (lora_deltas.gathered: every slot's shrink in one GEMM, each token's own read back by index), each layer
against the per-adapter GEMMs and each engine token for token against transformers + peft. tests/test_cuda.py runs
them compiled on the GPU."""
from __future__ import annotations

import pytest
import torch

from lora_compile import compile_policy
from lora_compile.model.forward_batch import LoRABatch
from lora_compile.model import quantization
from lora_compile.model import lora_deltas
from lora_compile.model.layers import LoRALinear
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
    reference = lora_deltas.segmented(compact, x, idx)
    assert reference.abs().max() > 1  # the adapters change something
    torch.testing.assert_close(lora_deltas.segmented(block, x, idx), reference, atol=1e-5, rtol=1e-5)
    lora = LoRABatch(idx).derive("grouped", block.max_loras + 1)
    assert lora.segment_offsets.tolist() == torch.bincount(idx, minlength=5).cumsum(0).tolist()
    assert torch.equal(idx[lora.token_order], idx.sort(stable=True).values)
    masks = LoRABatch(idx).derive("masked", block.max_loras + 1).slot_mask
    assert masks.sum(1).eq(1).all() and masks.int().argmax(1).tolist() == indices
    # The CPU's long steps (INDEXED_GROUPED): the grouped shrink over the compact B's layer, then the expand
    # grouped per output slice compiled (B compact, or chunk-major as in bfloat16), per adapter eager.
    chunked = _layer(4, 8, block_diagonal_b=False, b_chunk=8)
    grouped_shrinks = [lora_deltas.grouped(layer, x, lora, compiled)
                       for layer, compiled in ((compact, True), (chunked, True), (compact, False))]
    for delta in (lora_deltas.grouped(block, x, lora), lora_deltas.masked(block, x, masks), *grouped_shrinks):
        torch.testing.assert_close(delta, reference, atol=1e-5, rtol=1e-5)
        assert (delta[idx == 0] == 0).all()


def _load_slots_of(layer: LoRALinear, plain: LoRALinear) -> None:
    """`plain`'s four adapters loaded into `layer`'s slots (whatever its layout)."""
    r = plain.max_rank
    for slot in range(1, plain.max_loras + 1):
        layer.load_slot(slot, [(plain.lora_a(slot)[i * r:(i + 1) * r], plain.b_matrix(slot)[:, start:end].T)
                               for i, (start, end) in enumerate(plain._slices)])


@pytest.mark.parametrize("kernel", ["gathered", "stacked"])
@pytest.mark.parametrize("indices", [[3, 0, 1, 3, 1, 0, 2, 4], [0, 0], [2]], ids=["mixed", "base", "one"])
def test_gathered_kernels_equal_per_adapter_gemms(kernel, indices):
    """The "gathered" and "stacked" layers (every slot's shrink in one GEMM, the stacked one's inside the base GEMM;
    each token's own read back by index in the expand), eager and compiled, give the per-adapter GEMMs' output
    (float32) and exactly the base output for base-model tokens; "stacked" holds one tensor, its weight and A
    stack over its memory, and the base-only step reads its base rows."""
    plain = _layer(4, 8, block_diagonal_b=False)
    torch.manual_seed(0)
    layer = LoRALinear(32, (24, 8, 8), False, 4, 8, torch.float32, torch.device("cpu"),
                       stacked_a=kernel == "stacked", gathered=True)
    layer.weight.copy_(plain.weight)
    _load_slots_of(layer, plain)
    if kernel == "stacked":
        stacked = layer.weight_stacked
        assert stacked.shape == (40 + 5 * 24, 32) and layer.weight.data_ptr() == stacked.data_ptr()
        assert layer.lora_a_stack.data_ptr() == stacked[40:].data_ptr()
    else:
        assert layer.weight_stacked is None
    x, idx = torch.randn(len(indices), 32), torch.tensor(indices)
    reference = plain(x, LoRABatch(idx))
    compiled = torch.compile(lambda x, i: layer(x, LoRABatch(i), compiled=True), fullgraph=True, dynamic=True)
    for got in (layer(x, LoRABatch(idx)), compiled(x, idx)):
        torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[idx == 0], x[idx == 0] @ plain.weight.T, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer(x, LoRABatch(None)), x @ plain.weight.T, atol=1e-5, rtol=1e-5)


def test_stacked_kernel_on_a_quantized_projection_takes_the_gathered_form():
    """A quantized base weight has no rows to stack A under: the projection keeps its A stack apart and runs the
    gathered form (a shrink GEMM of its own), with the same deltas."""
    layer = LoRALinear(32, (24, 8, 8), False, 4, 8, torch.float32, torch.device("cpu"), quant="int8",
                       stacked_a=True, gathered=True)
    plain = _layer(4, 8, block_diagonal_b=False)
    qt = quantization.quantize_int8(plain.weight)
    layer.load_quantized(qt)
    _load_slots_of(layer, plain)
    assert layer.weight_stacked is None and layer.weight is None
    x, idx = torch.randn(6, 32), torch.tensor([1, 0, 4, 2, 3, 1])
    base = x @ qt.dequantize().T
    torch.testing.assert_close(layer(x, LoRABatch(idx)) - base, plain(x, LoRABatch(idx)) - x @ plain.weight.T,
                               atol=1e-4, rtol=1e-4)


def test_masked_kernel_isolates_an_overflowing_slot():
    """Another slot's shrink overflowing to inf leaves a token's delta finite: the mask replaces it, never
    multiplies it (0 x inf would be NaN)."""
    layer = _layer(4, 8, block_diagonal_b=True)
    layer.lora_a_stack[2].fill_(3e38)
    x = torch.ones(3, 32)
    idx = torch.tensor([1, 2, 3])
    delta = lora_deltas.masked(layer, x, LoRABatch(idx).derive("masked", 5).slot_mask)
    assert delta[[0, 2]].isfinite().all() and not delta[1].isfinite().all()
    # The gathered expand reads each token's own slot's shrink only: the overflow stays in its token's row.
    compact = _layer(4, 8, block_diagonal_b=False)
    compact.lora_a_stack[2].fill_(3e38)
    delta = lora_deltas.gathered(compact, lora_deltas.shrink_all_slots(compact, x), idx)
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
    for kernel in ("masked", *compile_policy.GATHERED_KERNELS):  # plain GEMMs and reductions: anywhere
        assert compile_policy.lora_kernel(kernel, cpu, f32, 12, compiled=True) == kernel
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


@pytest.mark.parametrize("kernel,compiled", [("grouped", False), ("masked", False), ("gathered", False),
                                             ("stacked", False), ("stacked", True)])
def test_engine_matches_peft(models, adapters, kernel, compiled):
    """The engine with each kernel (float32; eager, and "stacked" compiled too), a batch mixing the base model and
    three adapters of ranks 4-16 joining at different steps: exactly transformers + peft's greedy tokens, close
    logits."""
    engine = build_engine(models["llama"], adapters["llama"], compile=compiled, lora_kernel=kernel)
    assert engine.model.lora_kernel == kernel
    tokens, logits = run_joining(engine, PROMPTS, adapters=MIXED, join_at=JOIN_AT)
    assert_matches_reference(models["llama"], PROMPTS, tokens, logits,
                             [adapters["llama"][n] if n else None for n in MIXED])
