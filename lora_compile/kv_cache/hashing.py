"""Content hashes of full KV blocks, chained (vLLM v1's scheme): a block's hash covers its parent's hash, its
token ids and, through the chain's root, whose weights computed it.

The root is the adapter's cache identity (its name and a digest of the weights in its device slot), or the base
model's own key (an activated adapter's chain starts as the base model's and hands over where it acts:
activation_hash): blocks computed under one adapter are never found by another, nor by other weights loaded later
under the same name (vLLM #30931, #42125). SHA-256 rather than Python's hash(): a tenant must not be able to craft
token ids whose blocks collide with another tenant's.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

BASE_MODEL_KEY = b"base-model"


def root_hash(cache_key: bytes) -> bytes:
    """The parent hash of a sequence's first block."""
    return hashlib.sha256(b"lora-serve-kv\0" + cache_key).digest()


def activation_hash(parent: bytes, adapter_root: bytes, offset: int) -> bytes:
    """The parent hash of an activated adapter's first block (lora/adapters.activation_start): where the base
    model's chain hands over to the adapter's, `offset` positions into that block. Blocks before it are the base
    model's (found by base requests too); this and every later block are the adapter's, and a different offset is a
    different chain (the same tokens computed from another position on)."""
    return hashlib.sha256(b"lora-serve-activate\0" + parent + adapter_root + offset.to_bytes(8, "little")).digest()


def block_hashes(parent: bytes, tokens: Sequence[int], block_size: int, start_block: int = 0,
                 end_block: int | None = None) -> list[bytes]:
    """Hashes of the full blocks [start_block, end_block) of `tokens`; `parent` is the hash of block start_block - 1
    (the root for block 0)."""
    n_full = len(tokens) // block_size if end_block is None else end_block
    out = []
    for i in range(start_block, n_full):
        chunk = np.asarray(tokens[i * block_size:(i + 1) * block_size], dtype=np.int64)
        parent = hashlib.sha256(parent + chunk.tobytes()).digest()
        out.append(parent)
    return out
