"""An embedding table kept as a GGUF file's blocks: a lookup gathers its rows' codes and scales and dequantises
only those rows (the table itself is never widened)."""
from __future__ import annotations

import torch
from torch import nn

from .tensor import INT4_OFFSET, QuantizedTensor


class QuantizedEmbedding(nn.Module):
    """int4 groups (two codes a byte, the even column in the low nibble) or int8 groups, each group's scale and
    zero in float32: a looked-up row is computed in float32 and rounded once to the activation dtype, so it equals
    the dequantised table's row in that dtype exactly."""

    def __init__(self, num_embeddings: int, embedding_dim: int, kind: str, group_size: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.kind, self.group_size, self.dtype, self.device = kind, group_size, dtype, device
        self.register_buffer("codes", None, persistent=False)
        self.register_buffer("scale", None, persistent=False)
        self.register_buffer("zero", None, persistent=False)

    @torch.no_grad()
    def load(self, qt: QuantizedTensor) -> None:
        if (qt.kind, qt.group_size, qt.shape) != (self.kind, self.group_size, (self.num_embeddings, self.embedding_dim)):
            raise ValueError(f"expected {self.kind} groups of {self.group_size} of "
                             f"{(self.num_embeddings, self.embedding_dim)}, got {qt.kind} {qt.group_size} {qt.shape}")
        codes = qt.codes
        if self.kind == "int4":
            codes = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
        self.codes = codes.contiguous().to(self.device)
        self.scale = qt.scale.float().contiguous().to(self.device)
        self.zero = qt.zero.float().contiguous().to(self.device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.codes[ids]
        if self.kind == "int4":
            q = torch.stack([rows & 0x0F, rows >> 4], dim=-1).flatten(-2).float() - INT4_OFFSET
        else:
            q = rows.float()
        w = q.unflatten(-1, (-1, self.group_size)) * self.scale[ids].unsqueeze(-1) + self.zero[ids].unsqueeze(-1)
        return w.flatten(-2).to(self.dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero) if t is not None)
