"""A GGUF file's 4-, 5- and 8-bit blocks as the quantized tensors they are, exactly (gguf.quants' layouts)."""
from __future__ import annotations

import numpy as np
import torch

from .tensor import GGUF_GROUP, INT4_OFFSET, QuantizedTensor

EXACT_INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # GGUF types that are int4 groups of 32 as they are
EXACT_INT8_TYPES = ("Q8_0", "Q5_0", "Q5_1")  # GGUF types that are int8 groups of 32 as they are


def from_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedTensor:
    """A GGUF tensor of Q4_0, Q4_1 or Q4_K blocks (the file's bytes, rows of blocks along K) as int4 groups of 32,
    exactly: the codes as stored, each group's scale and zero from the block's own fields (gguf.quants' layout)."""
    import gguf.quants as quants

    n, k = shape
    blocks = np.asarray(raw, dtype=np.uint8).reshape(n * k // (256 if type_name == "Q4_K" else 32), -1)
    if type_name in ("Q4_0", "Q4_1"):
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]
        body = 4 if type_name == "Q4_1" else 2
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0] if type_name == "Q4_1" else None
        qs = blocks[:, body:]  # 16 bytes: weights 0-15 in the low nibbles, 16-31 in the high ones
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
        # Q4_0: w = d (q - 8); Q4_1: w = d q + m = d (q - 8) + (m + 8 d)
        zero = np.zeros_like(d) if m is None else m + INT4_OFFSET * d
        scale = d
    elif type_name == "Q4_K":
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mins = quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
        qs = blocks[:, 16:].reshape(-1, 4, 32)  # 4 chunks of 64 weights: 32 low nibbles, then 32 high ones
        codes = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)
        scale = d * sc.astype(np.float32)                    # (blocks, 8): each 32-weight sub-block's
        zero = INT4_OFFSET * scale - dmin * mins.astype(np.float32)  # w = scale q - dmin m
    elif type_name in EXACT_INT8_TYPES:
        return _int8_blocks(blocks, type_name, n, k)
    else:
        raise ValueError(f"GGUF type {type_name} has no exact kernel form here")
    codes = torch.from_numpy(np.ascontiguousarray(codes.reshape(n, k)))
    groups = k // GGUF_GROUP
    return QuantizedTensor("int4", codes, torch.from_numpy(np.ascontiguousarray(scale.reshape(n, groups))),
                           torch.from_numpy(np.ascontiguousarray(zero.reshape(n, groups))), GGUF_GROUP)


def _int8_blocks(blocks: np.ndarray, type_name: str, n: int, k: int) -> QuantizedTensor:
    """Q8_0 (w = d q, q int8) and Q5_0 / Q5_1 (w = d (q - 16) / d q + m, q 5 bits: a low nibble in qs and a high bit
    in qh) blocks of 32 as int8 groups of 32: w = code * scale + zero."""
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]
    zero = np.zeros_like(d)
    if type_name == "Q8_0":
        codes = blocks[:, 2:].copy().view(np.int8)
    else:
        body = 4 if type_name == "Q5_1" else 2
        if type_name == "Q5_1":
            zero = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
        qh = blocks[:, body:body + 4].copy().view(np.uint32)[:, 0]
        qs = blocks[:, body + 4:]
        high = (qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1
        codes = (np.concatenate([qs & 0x0F, qs >> 4], axis=1) | (high << 4).astype(np.uint8)).astype(np.int8)
        if type_name == "Q5_0":
            codes = codes - np.int8(16)
    groups = k // GGUF_GROUP
    return QuantizedTensor("int8", torch.from_numpy(np.ascontiguousarray(codes.reshape(n, k))),
                           torch.from_numpy(np.ascontiguousarray(d.reshape(n, groups))),
                           torch.from_numpy(np.ascontiguousarray(zero.reshape(n, groups))), GGUF_GROUP)
