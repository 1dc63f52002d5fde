"""Per-step inputs of the decoder layers: views into one preallocated metadata buffer.

Every field is a tensor (never a Python int), so one compiled graph serves any batch: sizes that vary
between steps are dynamic dimensions of these tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class AttentionMetadata:
    # Tokens of the step are laid out flat: [sequences with one token | prefill chunks | one dummy].
    slot_mapping: torch.Tensor       # (T,) where each token's K/V goes: kv_slot * max_seq_len + position
    decode_token_idx: torch.Tensor   # (Bd,) flat index of the single token of each "decode" sequence
    decode_q_pos: torch.Tensor       # (Bd,) its position
    decode_kv_slots: torch.Tensor    # (Bd,)
    decode_key_pos: torch.Tensor     # (Sd,) 0..Sd-1: keys read by the decode group
    prefill_token_idx: torch.Tensor  # (Bp, Lp) flat index of each chunk token, padded
    prefill_q_pos: torch.Tensor      # (Bp, Lp) position of each chunk token (0 on padding)
    prefill_kv_slots: torch.Tensor   # (Bp,)
    prefill_key_pos: torch.Tensor    # (Sp,)
    out_idx: torch.Tensor            # (T,) row of each token in cat(decode output, prefill output)


@dataclass
class LoRABatch:
    # (T,) each token's LoRA slot, its row in the layers' stacked LoRA weights: 0 for base-model tokens (zero rows),
    # device slots 1..max_loras_per_batch. None when no token of the step uses an adapter.
    weight_indices: torch.Tensor | None


@dataclass
class ForwardBatch:
    cos: torch.Tensor  # (T, head_dim) rotary tables gathered at each token's position
    sin: torch.Tensor
    attn: AttentionMetadata
    lora: LoRABatch

    def flat(self) -> tuple[torch.Tensor | None, ...]:
        """Every field in a fixed order (weight_indices last), for calls that take only plain arguments."""
        md = self.attn
        return (self.cos, self.sin, *(getattr(md, name) for name in _ATTN_FIELDS), self.lora.weight_indices)

    @classmethod
    def from_flat(cls, flat: tuple[torch.Tensor | None, ...]) -> ForwardBatch:
        attn = AttentionMetadata(*flat[2:-1])
        return cls(cos=flat[0], sin=flat[1], attn=attn, lora=LoRABatch(flat[-1]))


_ATTN_FIELDS = tuple(f.name for f in fields(AttentionMetadata))
