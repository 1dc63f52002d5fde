"""Building blocks of the decoder: RMSNorm, rotary embedding tables and the multi-LoRA linear layer."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .forward_batch import LoRABatch
from .packed_gemm import linear, packed_linear, prepack


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and cast back before the weight, as the reference implementation does.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq
    if rs.rope_type == "linear":
        return inv_freq / rs.factor
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(cfg: ModelConfig, max_seq_len: int, dtype: torch.dtype, device: torch.device):
    """cos/sin for every position, computed once: a step only gathers rows by position."""
    inv_freq = rope_inv_freq(cfg)
    freqs = torch.arange(max_seq_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype=dtype, device=device), emb.sin().to(dtype=dtype, device=device)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (T, heads, head_dim); cos/sin: (T, head_dim)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class LoRALinear(nn.Module):
    """A linear layer (optionally several fused ones: qkv, gate_up) plus stacked LoRA slots.

    Rows of `weight_ext` are the base weight followed by every slot's A (slot s at s-1; the base model,
    slot 0, has no storage): one GEMM over its first `out + m·c·r` rows gives the base output and the LoRA
    shrink of slots 1..m at once, with no copy. `lora_b[:, s-1]` is slot s's B (out, r), scaling folded in,
    so `lora_b[:, :m]` viewed as (out, m·r) expands every slot at once, again with no copy.
    Ranks below max_rank are zero-padded. Everything constant is a buffer created here: nothing is rebuilt
    per batch.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: tuple[int, ...],
        bias: bool,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        out_features = sum(output_sizes)
        self.in_features, self.out_features = in_features, out_features
        self.output_sizes = tuple(output_sizes)
        self.max_rank = max_rank
        self.slot_rows = len(output_sizes) * max_rank  # rows of A per slot
        # One spare slot that stays zero: slices [:m] are then never a whole dimension, so a step using every
        # slot has the same strides (and compiled graph) as one using fewer.
        n_stored = max_loras + 1
        self.register_buffer(
            "weight_ext",
            torch.zeros(out_features + n_stored * self.slot_rows, in_features, dtype=dtype, device=device),
            persistent=False,
        )
        # The checkpoint's weight is a view of the first rows: loading writes straight into weight_ext.
        self.weight = nn.Parameter(self.weight_ext[:out_features], requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )
        offsets = [0]
        for size in output_sizes:
            offsets.append(offsets[-1] + size)
        # Where each fused projection's output starts: [0, q, q+kv, q+2kv] for qkv, [0, i, 2i] for gate_up.
        self.register_buffer("output_offset", torch.tensor(offsets, dtype=torch.int64, device=device), persistent=False)
        # Python copy of the same offsets: slicing by them in the compiled graph keeps the shapes static.
        self._slices = tuple(zip(offsets[:-1], offsets[1:]))
        self.register_buffer(
            "lora_b", torch.zeros(out_features, n_stored, max_rank, dtype=dtype, device=device), persistent=False
        )
        self.max_loras = max_loras
        # oneDNN-packed copies (CPU float32, see packed_gemm), set by prepack() after loading: the base weight;
        # and, for steps with several adapters, every slot's A at once and, per output slice, every slot's B
        # at once (repacked when a slot changes: 0.4-0.8 ms per module at SmolLM2-135M's shapes, ~70 ms a load).
        self.register_buffer("weight_packed", None, persistent=False)
        self.register_buffer("lora_a_packed", None, persistent=False)
        for i in range(len(self._slices)):
            self.register_buffer(f"lora_b_all{i}", None, persistent=False)
            self.register_buffer(f"lora_b_packed{i}", None, persistent=False)

    @torch.no_grad()
    def prepack(self) -> None:
        self.weight_packed = prepack(self.weight)
        self._repack_lora()

    def _lora_a_all(self) -> torch.Tensor:
        return self.weight_ext[self.out_features : self.out_features + self.max_loras * self.slot_rows]

    @torch.no_grad()
    def _repack_lora(self) -> None:
        if self.weight_packed is None:
            return
        self.lora_a_packed = prepack(self._lora_a_all())
        for i, (start, end) in enumerate(self._slices):
            b_all = self.lora_b[start:end, : self.max_loras].reshape(end - start, self.max_loras * self.max_rank)
            setattr(self, f"lora_b_all{i}", b_all.contiguous())
            setattr(self, f"lora_b_packed{i}", prepack(b_all))

    def _forward_all_slots_packed(self, x: torch.Tensor, lora: LoRABatch) -> torch.Tensor:
        """Several adapters, packed weights: shrink and expand over every slot (unused ones masked to zero),
        three oneDNN GEMMs where the per-slot-count form runs MKL ones 2-3x slower at these sizes."""
        tokens, m, r, n = x.shape[0], lora.token_mask.shape[1], self.max_rank, self.max_loras
        shrink = packed_linear(x, self._lora_a_all(), self.lora_a_packed)
        mask = F.pad(lora.token_mask, (0, n - m)).view(tokens, n, 1, 1)
        h = shrink.view(tokens, n, len(self.output_sizes), r) * mask
        deltas = [
            packed_linear(
                h[:, :, i, :].reshape(tokens, n * r), getattr(self, f"lora_b_all{i}"),
                getattr(self, f"lora_b_packed{i}"),
            )
            for i in range(len(self._slices))
        ]
        return self._base(x) + (deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=-1))

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.weight_packed)
        return y if self.bias is None else y + self.bias

    def lora_a(self, slot: int) -> torch.Tensor:
        """Slot `slot`'s stacked A rows, (c·max_rank, in): a view into weight_ext."""
        start = self.out_features + (slot - 1) * self.slot_rows
        return self.weight_ext[start : start + self.slot_rows]

    def forward(self, x: torch.Tensor, lora: LoRABatch) -> torch.Tensor:
        m = lora.token_mask.shape[1]
        if m == 0:  # base-model-only step: its own graph, with no LoRA work at all
            return self._base(x)
        tokens, r, out = x.shape[0], self.max_rank, self.out_features
        if self.lora_a_packed is not None and m >= 2:
            return self._forward_all_slots_packed(x, lora)
        if self.weight_packed is not None:  # packed base GEMM, then the shrink by slots 1..m on its own
            base = self._base(x)
            shrink = linear(x, self.weight_ext[out : out + m * self.slot_rows])
        else:  # one GEMM: base output | shrink by slots 1..m
            y = linear(x, self.weight_ext[: out + m * self.slot_rows])
            base = y[:, :out] if self.bias is None else y[:, :out] + self.bias
            shrink = y[:, out:]
        # Keep each token's own slot (mask), then expand with every slot's B at once. (F.linear here: with
        # K = m·r this small, the weight-on-the-left form is the slower one; measured.)
        h = shrink.reshape(tokens, m, len(self.output_sizes), r) * lora.token_mask.view(tokens, m, 1, 1)
        deltas = [
            F.linear(h[:, :, i, :].reshape(tokens, m * r), self.lora_b[start:end, :m].reshape(end - start, m * r))
            for i, (start, end) in enumerate(self._slices)
        ]
        return base + (deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=-1))

    @torch.no_grad()
    def load_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Copy one adapter into `slot` (>= 1) in place, then rebuild the packed copies (same shapes: they are
        graph inputs, so nothing recompiles).

        parts[i] is (A (r, in), B_scaled (out_i, r)) for output slice i, or None where the adapter lacks it.
        """
        self._zero_slot(slot)
        a_rows, b = self.lora_a(slot), self.lora_b[:, slot - 1]
        for i, part in enumerate(parts):
            if part is None:
                continue
            a_part, b_part = part
            r = a_part.shape[0]
            start, end = self._slices[i]
            a_rows[i * self.max_rank : i * self.max_rank + r].copy_(a_part)
            b[start:end, :r].copy_(b_part)
        self._repack_lora()

    @torch.no_grad()
    def clear_slot(self, slot: int) -> None:
        self._zero_slot(slot)
        self._repack_lora()

    def _zero_slot(self, slot: int) -> None:
        self.lora_a(slot).zero_()
        self.lora_b[:, slot - 1].zero_()
