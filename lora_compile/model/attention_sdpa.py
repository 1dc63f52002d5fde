"""Attention over the paged KV cache through torch's scaled_dot_product_attention (EngineConfig.attention_backend
"sdpa"; by default prompt chunks on every device and decode on CUDA: compile_policy.attention_backend and
prefill_attention_backend). On the CPU torch runs it in its flash kernel for the CPU.

Each sequence's keys and values are gathered through its block table into (B, Hkv, S, D) (one copy each, which
Inductor fuses with the gather and the zeroing of stale rows), and the query heads of one KV head are the query
rows of one (B, Hkv) problem: grouped-query attention without repeating K or V. torch runs it in its fused
attention kernels (memory-efficient or cuDNN), where the Inductor-generated reductions of model.attend_decode
read the keys at a fraction of the GPU's bandwidth (on an H200, 160 us a layer for the scores of a batch-64
step over 128 keys: docs/benchmarks.md).

Keys past a sequence's last query were written by an earlier holder of the block, by padding, or are the null
block's: their scores are masked, and K and V there are replaced by zeros first, since a masked score is added
as -inf inside the kernel and -inf + NaN, or 0 x NaN, is NaN. Soft-capped scores (Gemma 2) have no SDPA form:
those models keep the reductions.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import onednn_float32


def _gather(cache: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, Hkv, S, D) in `dtype` from a (num_blocks, block_size, Hkv, D) pool: rows (B, S) of the flattened pool
    (model.kv_rows); where keep (B, S) is False, zeros."""
    _, _, n_kv, head_dim = cache.shape
    gathered = cache.view(-1, n_kv, head_dim)[rows].masked_fill(~keep[:, :, None, None], 0)
    return gathered.to(dtype).transpose(1, 2)


def sdpa_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, token_idx: torch.Tensor,
                q_pos: torch.Tensor, rows: torch.Tensor, scale: float,
                sliding_window: int | torch.Tensor | None) -> torch.Tensor:
    """One query per sequence (B,) at positions q_pos over keys 0..S-1 (rows (B, S): where each lives in the
    pool); q (T, H, D). Returns (B, H*D)."""
    batch = token_idx.shape[0]
    n_heads, head_dim = q.shape[1], q.shape[2]
    n_kv = k_cache.shape[2]
    pos = torch.arange(rows.shape[1], device=q.device)
    visible = pos[None, :] <= q_pos[:, None]  # (B, S)
    if sliding_window is not None:
        visible = visible & (pos[None, :] > q_pos[:, None] - sliding_window)
    k, v = _gather(k_cache, rows, visible, q.dtype), _gather(v_cache, rows, visible, q.dtype)
    qb = q[token_idx].view(batch, n_kv, n_heads // n_kv, head_dim)
    out = F.scaled_dot_product_attention(qb, k, v, attn_mask=visible[:, None, None, :], scale=scale)
    return out.reshape(batch, n_heads * head_dim)


def kv_rows(block_table: torch.Tensor, key_pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """(B, S): the row of the flattened KV pool that holds key position key_pos[s] of sequence b. Compiled, this
    is index arithmetic inside the attention reductions' loads, not a tensor."""
    return block_table[:, key_pos // block_size] * block_size + key_pos % block_size


def prefill_mask(q_pos: torch.Tensor, key_pos: torch.Tensor, group: int,
                 sliding_window: int | torch.Tensor | None) -> torch.Tensor:
    """(B, 1, L*group, S) bool: which keys each query row of sdpa_prefill sees; rows (l, g) are token l's query
    head g of a KV head, and each sees what its token sees."""
    batch, length = q_pos.shape
    s = key_pos.shape[0]
    visible = key_pos[None, None, :] <= q_pos[:, :, None]  # (B, L, S)
    if sliding_window is not None:
        visible = visible & (key_pos[None, None, :] > q_pos[:, :, None] - sliding_window)
    return visible[:, None, :, None, :].expand(batch, 1, length, group, s).reshape(batch, 1, length * group, s)


def sdpa_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, token_idx: torch.Tensor,
                 q_pos: torch.Tensor, rows: torch.Tensor, key_pos: torch.Tensor, scale: float,
                 sliding_window: int | torch.Tensor | None, mask: torch.Tensor | None = None,
                 float32: bool = False, onednn: bool = False) -> torch.Tensor:
    """Causal attention of each sequence's query block (B, L) over its keys key_pos (S,) (rows (B, S): where each
    lives in the pool); q (T, H, D). `mask`: prefill_mask's as additive scores, derived once per step
    (AttentionMetadata.derive_prefill), else made here as booleans. Returns (B*L, H*D), as model.attend does.
    `float32`: computed in float32 (compile_policy.prefill_attention_float32); `onednn`: float32 products through
    oneDNN, not MKL (compile_policy.prefill_attention_onednn)."""
    batch, length = token_idx.shape
    n_heads, head_dim = q.shape[1], q.shape[2]
    n_kv = k_cache.shape[2]
    group = n_heads // n_kv
    keep = key_pos[None, :] <= q_pos.amax(dim=1)[:, None]  # (B, S): up to the sequence's last query
    dtype = torch.float32 if float32 else q.dtype  # (compile_policy.prefill_attention_float32)
    k, v = _gather(k_cache, rows, keep, dtype), _gather(v_cache, rows, keep, dtype)
    qb = q[token_idx.reshape(-1)].to(dtype).view(batch, length, n_kv, group, head_dim)
    qb = qb.permute(0, 2, 1, 3, 4).reshape(batch, n_kv, length * group, head_dim)
    if mask is None:
        mask = prefill_mask(q_pos, key_pos, group, sliding_window)
    elif mask.dtype != dtype:  # (additive scores: 0 and -inf are exact in any float dtype)
        mask = mask.to(dtype)
    if onednn and dtype == torch.float32:
        out = onednn_float32.sdpa(qb, k, v, mask, scale).to(q.dtype)
    else:
        out = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale).to(q.dtype)
    out = out.view(batch, n_kv, length, group, head_dim)
    return out.permute(0, 2, 1, 3, 4).reshape(batch * length, n_heads * head_dim)
