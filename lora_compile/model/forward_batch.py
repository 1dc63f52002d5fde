"""Per-step inputs of the decoder layers: views into one preallocated metadata buffer.

Every field is a tensor (never a Python int), so one compiled graph serves any batch: sizes that vary
between steps are dynamic dimensions of these tensors, declared on each field with `dynamic(...)` (vLLM's
`dynamic_arg_dims`); compile_policy marks them, and knows no field by name or position.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch


# Every step's last token is a dummy (core.batch_init: it pads the decode and prefill groups to two rows) whose
# outputs are never read: a kernel that pays per row may leave it out (quantization.linear on the CPU).
DUMMY_TOKENS = 1


def dynamic(*dims: int, **kwargs):
    """A field whose dims `dims` vary between steps. Each is >= 2 by construction (a step has a dummy token, groups
    are padded to 2 rows), so 0/1 specialisation cannot add graphs after warm-up; every other dim is static."""
    return field(metadata={"dynamic_dims": dims}, **kwargs)


# Keys read by a decode-only step's prefill group, a padded placeholder; a real group reads more (padded to at
# least PLACEHOLDER_KEYS + 1), so the compiled layer tells them apart by size and skips the placeholder
# (model.attend_prefill).
PLACEHOLDER_KEYS = 2


@dataclass
class AttentionMetadata:
    # Tokens of the step are laid out flat: [sequences with one token | prefill chunks | one dummy].
    # Positions live in KV blocks (lora_compile.kv_cache): position p of a sequence is row
    # block_table[p // block_size] * block_size + p % block_size of the layers' flattened pools.
    slot_mapping: torch.Tensor = dynamic(0)       # (T,) the row each token's K/V is written to (0: the null block)
    decode_token_idx: torch.Tensor = dynamic(0)   # (Bd,) flat index of the single token of each "decode" sequence
    decode_q_pos: torch.Tensor = dynamic(0)       # (Bd,) its position
    decode_block_table: torch.Tensor = dynamic(0, 1)  # (Bd, Wd) its blocks, padded with the null block
    decode_key_pos: torch.Tensor = dynamic(0)     # (Sd,) 0..Sd-1: keys read by the decode group
    prefill_token_idx: torch.Tensor = dynamic(0, 1)  # (Bp, Lp) flat index of each chunk token, padded
    prefill_q_pos: torch.Tensor = dynamic(0, 1)   # (Bp, Lp) position of each chunk token (0 on padding)
    prefill_block_table: torch.Tensor = dynamic(0, 1)  # (Bp, Wp)
    prefill_key_pos: torch.Tensor = dynamic(0)    # (Sp,)
    out_idx: torch.Tensor = dynamic(0)            # (T,) row of each token in cat(decode output, prefill output)
    # Derived on the device once per step for the prefill group's SDPA form (derive_prefill), where every layer
    # reads the same; None otherwise. Made in every layer (the mask in bool, which SDPA turned into scores each
    # call), they were half of a 4,000-token prefill: 4.5 s against 2.2 s, bf16 on an AMX Xeon, one profile each.
    prefill_kv_rows: torch.Tensor | None = dynamic(0, 1, default=None)      # (Bp, Sp) pool row of each key
    prefill_mask: torch.Tensor | None = dynamic(0, 2, 3, default=None)      # (Bp, 1, Lp*G, Sp) 0 or -inf a score

    def derive_prefill(self, group: int, block_size: int, dtype: torch.dtype) -> AttentionMetadata:
        """This metadata with the prefill group's pool rows and causal mask (attention_sdpa.prefill_mask), for
        query heads in groups of `group` per KV head. The mask is additive, in the dtype attention computes in
        (compile_policy.prefill_attention_float32): SDPA turns a boolean one into that form on every call, which
        was most of a layer's own time at 4,000 keys."""
        from .attention_sdpa import kv_rows, prefill_mask
        rows = kv_rows(self.prefill_block_table, self.prefill_key_pos, block_size)
        visible = prefill_mask(self.prefill_q_pos, self.prefill_key_pos, group, None)
        mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))
        return replace(self, prefill_kv_rows=rows, prefill_mask=mask)


@dataclass
class LoRABatch:
    # (T,) each token's LoRA slot, its row in the layers' stacked LoRA weights: 0 for base-model tokens (zero rows),
    # device slots 1..max_loras_per_batch. None when no token of the step uses an adapter.
    weight_indices: torch.Tensor | None = dynamic(0)
    # Derived from weight_indices on the device once per step (derive()), never copied from the host; None unless
    # the model's LoRA kernel reads them (lora_deltas.grouped, lora_deltas.masked).
    token_order: torch.Tensor | None = dynamic(0, default=None)    # (T,) tokens sorted by slot, stable
    token_inverse: torch.Tensor | None = dynamic(0, default=None)  # (T,) each token's row in that order
    segment_offsets: torch.Tensor | None = None                    # (slots,) int32: where each slot's segment ends
    slot_mask: torch.Tensor | None = dynamic(0, default=None)      # (T, slots) bool: each token's own slot

    def derive(self, kernel: str, num_slots: int) -> LoRABatch:
        """This batch with what LoRA kernel `kernel` reads: device ops only (no host sync, nothing a CUDA graph
        could not replay). "grouped": a stable sort by slot, each token's row in that order and each slot's segment
        end (cumulative, as torch's grouped_mm takes offsets); "masked": each token's slot as a mask over all
        slots."""
        idx = self.weight_indices
        slots = torch.arange(num_slots, device=idx.device)
        if kernel == "masked":
            return LoRABatch(idx, slot_mask=idx[:, None] == slots[None, :])
        order = torch.argsort(idx, stable=True)
        offsets = (idx[None, :] == slots[:, None]).sum(1).cumsum(0).to(torch.int32)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(idx.shape[0], device=idx.device)
        return LoRABatch(idx, order, inverse, offsets)


@dataclass
class ForwardBatch:
    cos: torch.Tensor = dynamic(0)  # (T, head_dim) rotary tables gathered at each token's position
    sin: torch.Tensor = dynamic(0)
    attn: AttentionMetadata
    lora: LoRABatch
    # Inside the compiled layer stack (from_flat there): the layers take the kernels that need a compiler.
    compiled: bool = False

    def flat(self) -> tuple[torch.Tensor | None, ...]:
        """Every tensor, in the one fixed order, for calls that take only plain arguments (the compiled stack)."""
        return (self.cos, self.sin, *(getattr(self.attn, name) for name in _ATTN_NAMES),
                *(getattr(self.lora, name) for name in _LORA_NAMES))

    @classmethod
    def from_flat(cls, flat: tuple[torch.Tensor | None, ...], compiled: bool = False) -> ForwardBatch:
        cos, sin, *rest = flat
        return cls(cos, sin, AttentionMetadata(*rest[:_NUM_ATTN]), LoRABatch(*rest[_NUM_ATTN:]), compiled)

    @staticmethod
    def flat_variant(flat: tuple[torch.Tensor | None, ...]) -> int:
        """Which graph variant a flat() batch runs: 0 no adapters, 1 adapters, 2 adapters over segments (the
        grouped kernel's LoRABatch.derive fields present)."""
        if flat[_WEIGHT_INDICES] is None:
            return 0
        return 2 if flat[_SEGMENT_OFFSETS] is not None else 1

    def dynamic_dims(self) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
        """Each tensor present with its step-varying dims, as declared on its field."""
        return [(t, dims) for t, dims in zip(self.flat(), _FLAT_DYNAMIC_DIMS) if t is not None]


# Counted once here (the compiled stack calls from_flat, and Dynamo does not trace dataclasses.fields): the
# attention fields, and where LoRABatch.weight_indices sits in flat(), after cos, sin and them.
_ATTN_NAMES = tuple(f.name for f in fields(AttentionMetadata))
_LORA_NAMES = tuple(f.name for f in fields(LoRABatch))
_NUM_ATTN = len(_ATTN_NAMES)
_WEIGHT_INDICES = 2 + _NUM_ATTN
_SEGMENT_OFFSETS = _WEIGHT_INDICES + _LORA_NAMES.index("segment_offsets")
# The declared dynamic dims of each flat() entry, in flat() order: cos and sin, attention, LoRA.
_FLAT_DYNAMIC_DIMS = tuple(
    f.metadata.get("dynamic_dims", ())
    for f in (*fields(ForwardBatch)[:2], *fields(AttentionMetadata), *fields(LoRABatch))
)
