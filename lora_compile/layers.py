"""Building blocks of the decoder: RMSNorm, rotary embedding tables and the multi-LoRA linear layer."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .forward_batch import LoRABatch


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

    `lora_a[s]` holds slot s's A matrices stacked per output slice (rank zero-padded to max_rank);
    `lora_b[s]` holds B transposed, scaling folded in. Slot 0 is the base model and stays zero.
    Everything constant is a buffer created here, so nothing is rebuilt per batch.
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
        self.in_features = in_features
        self.output_sizes = tuple(output_sizes)
        self.max_rank = max_rank
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False)
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
        n_slots = max_loras + 1
        self.register_buffer(
            "lora_a", torch.zeros(n_slots, len(output_sizes) * max_rank, in_features, dtype=dtype, device=device),
            persistent=False,
        )
        self.register_buffer(
            "lora_b", torch.zeros(n_slots, max_rank, out_features, dtype=dtype, device=device), persistent=False
        )

    def forward(self, x: torch.Tensor, lora: LoRABatch) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        n = lora.active_slots.shape[0]
        if n == 0:  # base-model-only step: its own graph, with no LoRA work at all
            return y
        tokens, r, c = x.shape[0], self.max_rank, len(self.output_sizes)
        # Shrink with every active slot at once, then keep each token's own slot (mask) and expand.
        a = self.lora_a.index_select(0, lora.active_slots)  # (n, c*r, in)
        h = (x @ a.reshape(n * c * r, self.in_features).t()).view(tokens, n, c, r)
        h = h * lora.token_mask.view(tokens, n, 1, 1)
        b = self.lora_b.index_select(0, lora.active_slots)  # (n, r, out)
        deltas = [
            h[:, :, i, :].reshape(tokens, n * r) @ b[:, :, start:end].reshape(n * r, end - start)
            for i, (start, end) in enumerate(self._slices)
        ]
        return y + (deltas[0] if c == 1 else torch.cat(deltas, dim=-1))

    @torch.no_grad()
    def load_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Copy one adapter into `slot` in place (tensor identity never changes, so nothing recompiles).

        parts[i] is (A (r, in), B_scaled (out_i, r)) for output slice i, or None where the adapter lacks it.
        """
        r_max = self.max_rank
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for i, part in enumerate(parts):
            if part is None:
                continue
            a, b = part
            r = a.shape[0]
            start, end = self._slices[i]
            self.lora_a[slot, i * r_max : i * r_max + r].copy_(a)
            self.lora_b[slot, :r, start:end].copy_(b.t())

    @torch.no_grad()
    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
