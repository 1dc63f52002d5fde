"""The LoRA deltas of a step's tokens, one function per kernel (EngineConfig.lora_kernel, decided by
compile_policy.lora_kernel): each takes a LoRALinear and its input (or its shrink) and returns (T, out), the base
product apart. LoRALinear.forward picks one and adds it to the base output."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .forward_batch import LoRABatch

if TYPE_CHECKING:
    from .layers import LoRALinear


def indexed(layer: LoRALinear, x: torch.Tensor, weight_indices: torch.Tensor) -> torch.Tensor:
    """Compiled: each token reads its own slot's A and B by index inside the reductions; Inductor fuses the
    gather into the loop, so nothing is copied and a token costs one adapter's work whatever the mix. At decode
    sizes a LoRA GEMM costs its call, not its arithmetic: this form takes 1.8x (one adapter) to 3.2x (8 adapters)
    less LoRA time than GEMMs over masked slots (python -m benchmarks.lora_layer). In a long prefill chunk with a
    single adapter the GEMM form was cheaper (LoRA 2% of the layer against 6%); with 8 adapters this is 6x cheaper."""
    tokens, c, r = x.shape[0], len(layer.output_sizes), layer.max_rank
    shrink = (x[:, None, :] * layer.lora_a_stack[weight_indices]).sum(-1).view(tokens, c, r)
    return _expand_indexed(layer, shrink, weight_indices)


def _expand_indexed(layer: LoRALinear, shrink: torch.Tensor, weight_indices: torch.Tensor) -> torch.Tensor:
    """The indexed expand of each token's shrink (T, c, r) through its own slot's B, compact or chunk-major."""
    if layer.b_chunk:
        return _expand_chunk_major(layer, shrink, weight_indices)
    b = layer.lora_b[weight_indices]  # (T, r, out): indexing, fused into the reduction below
    deltas = [(shrink[:, i, :, None] * b[:, layer.b_rows(i), start:end]).sum(1)
              for i, (start, end) in enumerate(layer._slices)]
    return deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=-1)


def _expand_chunk_major(layer: LoRALinear, shrink: torch.Tensor, weight_indices: torch.Tensor) -> torch.Tensor:
    """The indexed expand over B stored chunk-major, its output laid out chunk-major too, (out / b_chunk, T,
    b_chunk), then added back in token order: a thread runs over output chunks, so the tokens of one adapter (the
    engine groups them) read the same contiguous 1 KiB block in turn, where rank rows `out` apart missed the cache
    for each token (bfloat16 decode steps with 8 adapters 5-8 % shorter: compile_policy.lora_b_chunk)."""
    tokens, k = shrink.shape[0], layer.b_chunk
    b = layer.lora_b[weight_indices].transpose(0, 1)  # (out / k, T, r, k): indexing, fused into the reduction
    deltas = [(shrink[None, :, i, :, None] * b[start // k:end // k]).sum(2)
              for i, (start, end) in enumerate(layer._slices)]
    delta = deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=0)
    return delta.transpose(0, 1).reshape(tokens, layer.out_features)


def grouped(layer: LoRALinear, x: torch.Tensor, lora: LoRABatch, compiled: bool = False) -> torch.Tensor:
    """CUDA (bf16): tokens sorted by slot (lora.token_order) form one segment per slot, whose ends
    (lora.segment_offsets) stay on the device; shrink and expand are grouped GEMMs over the segments, as SGLang's
    csgmv and Punica's SGMV group them: each slot's A and B read once a step, on tensor cores, with no host sync.
    Slot 0 (base-model tokens, zero rows) is a segment too: its product is exactly zero. torch's grouped_mm takes
    a 2D left operand split by offsets and a 3D right operand, one matrix per group; B is block-diagonal
    (block_diagonal_b), so one expand serves every slice.

    The CPU's long steps in bfloat16 (compile_policy.INDEXED_GROUPED) keep B in the indexed kernel's compact layout
    (no second copy): compiled, the expand is grouped per output slice (_expand_grouped_compact), eager per adapter.
    A block-diagonal second copy of B, one grouped expand for every slice, costs twice the slots' memory."""
    xs = x[lora.token_order]
    shrink = torch._grouped_mm(xs, layer.lora_a_stack.transpose(1, 2), offs=lora.segment_offsets)  # (T, c*r)
    if not layer.block_diagonal_b:
        if compiled:
            return _expand_grouped_compact(layer, shrink, lora)
        return _expand_segmented(layer, shrink[lora.token_inverse], lora.weight_indices)
    delta = torch._grouped_mm(shrink, layer.lora_b, offs=lora.segment_offsets)  # (T, out)
    return delta[lora.token_inverse]  # back to the step's token order (a gather Inductor fuses into the add)


def _expand_grouped_compact(layer: LoRALinear, shrink: torch.Tensor, lora: LoRABatch) -> torch.Tensor:
    """Compiled long CPU steps: the slot-sorted shrink (T, c·r) through one grouped GEMM per output slice over
    every slot's compact B for that slice (LoRALinear.b_all_slots), then back to the step's token order by one
    gather. Each slot's B is read once a step, where the indexed expand reads it once a token. 8 x 1,000-token
    prompts with 8 adapters (bf16, EPYC AVX-512, benchmarks.prefill): 6.75 s against 7.03 s indexed, twice each."""
    c, r = len(layer.output_sizes), layer.max_rank
    by_slice = shrink.view(-1, c, r)
    deltas = [torch._grouped_mm(by_slice[:, i].contiguous(), layer.b_all_slots(i), offs=lora.segment_offsets)
              for i in range(c)]
    delta = deltas[0] if c == 1 else torch.cat(deltas, dim=-1)
    return delta[lora.token_inverse]


def masked(layer: LoRALinear, x: torch.Tensor, slot_mask: torch.Tensor) -> torch.Tensor:
    """CUDA decode: every token through every slot's A in one GEMM (all slots' A rows side by side), each token's
    own slot's shrink kept (slot_mask) and the rest replaced by zeros, then one GEMM through every slot's
    block-diagonal B: two plain GEMMs on tensor cores reading each adapter's weights once, no sort, no gather.
    The shrink's arithmetic grows with the slots (T x in x slots·c·r), which costs nothing at decode sizes but a
    share of a long prefill's. Replaced, never multiplied by the mask: another slot's shrink may overflow, and
    0 x inf would be NaN in this token's row."""
    tokens, slots, rows = x.shape[0], layer.lora_a_stack.shape[0], layer.slot_rows
    shrink = shrink_all_slots(layer, x).view(tokens, slots, rows)
    shrink = torch.where(slot_mask[:, :, None], shrink, 0).view(tokens, slots * rows)
    return shrink @ layer.lora_b.view(slots * rows, -1)


def shrink_all_slots(layer: LoRALinear, x: torch.Tensor) -> torch.Tensor:
    """Every token through every slot's A in one GEMM (all slots' A rows side by side): (T, slots·c·r), what the
    masked and gathered kernels start from."""
    return F.linear(x, layer.lora_a_stack.view(-1, layer.in_features))


def gathered(layer: LoRALinear, shrink: torch.Tensor, weight_indices: torch.Tensor) -> torch.Tensor:
    """The expand of the "gathered" and "stacked" kernels (CUDA): `shrink` (T, slots·c·r) is every token through
    every slot's A (one GEMM, or columns of the base GEMM's output: LoRALinear.weight_stacked); each output reads
    its token's own slot's r shrink values and r rows of B by index and sums them, in one reduction that Inductor
    fuses with the add into the base output. So a projection's LoRA costs at most one GEMM and no kernel of its own
    beyond that reduction, where "masked" runs three (shrink GEMM, mask, expand GEMM over every slot). No mask:
    another slot's shrink is never read, so its overflow cannot reach this token. B compact, (slots, r, out)."""
    tokens, c, r = shrink.shape[0], len(layer.output_sizes), layer.max_rank
    # Each output's slice, from the slices' bounds (Python ints): compiled, an index computed in the kernel, no
    # tensor read or copied.
    outputs = torch.arange(layer.out_features, device=shrink.device)
    part = sum((outputs >= start).long() for start, _ in layer._slices[1:]) if c > 1 else torch.zeros_like(outputs)
    own = shrink.reshape(tokens, -1, c, r)[torch.arange(tokens, device=shrink.device)[:, None],
                                           weight_indices[:, None], part[None, :]]  # (T, out, r): indexing, fused
    b = layer.lora_b[weight_indices].transpose(1, 2)  # (T, out, r)
    # Summed in float32, rounded once (compiled, Inductor's reductions do so anyway; eager would round each product).
    return (own.float() * b.float()).sum(-1).to(shrink.dtype)


def segmented(layer: LoRALinear, x: torch.Tensor, weight_indices: torch.Tensor) -> torch.Tensor:
    """Eager: one GEMM pair per adapter in the step over its own tokens. (Eager would materialise the indexed
    form's per-token weights; this reads the distinct slots on the host, which only eager may do.)"""
    return _expand_segmented(layer, None, weight_indices, x)


def _expand_segmented(layer: LoRALinear, shrink: torch.Tensor | None, weight_indices: torch.Tensor,
                      x: torch.Tensor | None = None) -> torch.Tensor:
    """Eager, per adapter in the step: its tokens' shrink (given, (T, c·r), or made here from x) through its B."""
    c, r = len(layer.output_sizes), layer.max_rank
    rows_of_all = shrink if shrink is not None else x
    delta = rows_of_all.new_zeros(rows_of_all.shape[0], layer.out_features)
    for index in weight_indices.unique().tolist():
        if index == 0:  # base-model tokens: zero rows
            continue
        rows = (weight_indices == index).nonzero().squeeze(1)
        own = shrink[rows] if shrink is not None else F.linear(x[rows], layer.lora_a_stack[index])
        own = own.view(-1, c, r)
        b = layer.b_matrix(index)
        delta[rows] = torch.cat([own[:, i] @ b[layer.b_rows(i), start:end] for i, (start, end) in enumerate(layer._slices)],
                                dim=-1)
    return delta
