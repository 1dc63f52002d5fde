"""A quantized weight as codes and scales, unpacked, and quantizing a float weight at load (int4 min-max in groups,
int8 symmetric per row)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

GGUF_GROUP = 32  # a GGUF 4-bit block (or K-type sub-block)
GROUP_SIZES = (32, 64, 128, 256)
INT4_OFFSET = 8  # torch's int4 kernels read a code q as q - 8


@dataclass
class QuantizedTensor:
    """A weight (N out, K in) as codes and their scales, unpacked (loading builds one per module, then packs the
    projection's): int4: codes uint8 (N, K) in [0, 15], scale and zero float32 (N, K / group_size), w = (q - 8) s + z;
    int8 per row (group_size 0): codes int8 (N, K), scale float32 (N,), w = q s; int8 in groups (a GGUF's Q8_0 and
    Q5 blocks): codes int8 (N, K), scale and zero float32 (N, K / group_size), w = q s + z."""

    kind: str
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None
    group_size: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight it stands for (the reference its kernels are checked against)."""
        if self.kind == "int8" and not self.group_size:
            return self.codes.float() * self.scale[:, None]
        scale = self.scale.repeat_interleave(self.group_size, dim=1)
        zero = self.zero.repeat_interleave(self.group_size, dim=1)
        offset = INT4_OFFSET if self.kind == "int4" else 0
        return (self.codes.float() - offset) * scale + zero

    def rows(self, order: torch.Tensor) -> QuantizedTensor:
        """The same weight with its output rows reordered (llama.cpp's Q/K row order undone)."""
        zero = None if self.zero is None else self.zero[order]
        return QuantizedTensor(self.kind, self.codes[order], self.scale[order], zero, self.group_size)


def cat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """A fused projection's weight: its modules' rows one after another (they share kind and group size)."""
    first = parts[0]
    if any(p.kind != first.kind or p.group_size != first.group_size for p in parts):
        raise ValueError("a fused projection's modules must share one quantized form")
    zero = None if first.zero is None else torch.cat([p.zero for p in parts])
    return QuantizedTensor(first.kind, torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]), zero,
                           first.group_size)


def quantize_int4(weight: torch.Tensor, group_size: int) -> QuantizedTensor:
    """Min-max int4 in groups of `group_size` along K: scale = (max - min) / 15, codes = round((w - min) / scale)."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"int4 groups of {group_size} need the input size to divide into them, got {k}")
    groups = weight.float().reshape(n, k // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = (high - low) / 15
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.round((groups - low[..., None]) / safe[..., None]).clamp(0, 15).to(torch.uint8)
    # w = q * scale + low = (q - 8) * scale + (low + 8 * scale)
    return QuantizedTensor("int4", codes.reshape(n, k), scale, low + INT4_OFFSET * scale, group_size)


def quantize_int8(weight: torch.Tensor) -> QuantizedTensor:
    """Symmetric int8 per output row: scale = max |w| / 127."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.round(w / safe[:, None]).clamp(-127, 127).to(torch.int8)
    return QuantizedTensor("int8", codes, scale)
