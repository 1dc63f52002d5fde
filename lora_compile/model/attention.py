"""Attention over the paged KV cache as plain torch for Inductor: queries read keys and values through the block
table's flat rows, one form for prefill chunks and one for decode (attend_decode), and the prefill group's
switch between the fused kernel (attention_sdpa) and these reductions."""
from __future__ import annotations

import torch

from .. import compile_policy
from . import onednn_float32
from .attention_sdpa import kv_rows, sdpa_prefill
from .forward_batch import PLACEHOLDER_KEYS, AttentionMetadata


def attend(
    q: torch.Tensor,            # (T, H, D) queries of every token of the step
    k_cache: torch.Tensor,      # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,
    token_idx: torch.Tensor,    # (B, L) which tokens form each sequence's query block
    q_pos: torch.Tensor,        # (B, L)
    block_table: torch.Tensor,  # (B, W) each sequence's KV blocks, W * block_size >= S
    key_pos: torch.Tensor,      # (S,) keys 0..S-1 are read
    scale: float,
    sliding_window: int | torch.Tensor | None,  # a tensor where layers differ (Attention.window)
    float32: bool = False,
    softcap: float | None = None,
    onednn: bool = False,
) -> torch.Tensor:
    """Causal attention of each sequence's query block over its cached keys; returns (B*L, H*D). `float32`: both
    products in float32 whatever the cache holds. `softcap`: scores -> tanh(scores / softcap) * softcap.
    `onednn`: float32 products on oneDNN, not MKL (compile_policy.prefill_attention_onednn)."""
    work = torch.float32 if float32 else q.dtype
    matmul = onednn_float32.matmul if onednn and work == torch.float32 else torch.matmul
    batch, length = token_idx.shape
    n_heads, head_dim = q.shape[1], q.shape[2]
    n_kv = k_cache.shape[2]
    group = n_heads // n_kv
    s = key_pos.shape[0]
    rows = kv_rows(block_table, key_pos, k_cache.shape[1])
    # Grouped-query attention without repeating K/V: query heads of one KV head form one block.
    qb = q[token_idx.reshape(-1)].view(batch, length, n_kv, group, head_dim)
    qb = qb.permute(0, 2, 1, 3, 4).reshape(batch, n_kv, length * group, head_dim).to(work)
    k = k_cache.view(-1, n_kv, head_dim)[rows].permute(0, 2, 3, 1).to(work)  # (B, Hkv, D, S)
    # Keys past a sequence's last query were written by an earlier holder of the block (or by padding, or are the
    # null block's): their probability is 0, but 0 x NaN is NaN, so stale values are replaced, never multiplied.
    stale = key_pos[None, :] > q_pos.amax(dim=1)[:, None]  # (B, S)
    v = v_cache.view(-1, n_kv, head_dim)[rows].masked_fill(stale[:, :, None, None], 0)
    v = v.permute(0, 2, 1, 3).to(work)  # (B, Hkv, S, D)
    scores = matmul(qb, k) * scale
    scores = _softcap(scores, softcap).float().view(batch, n_kv, length, group, s)
    visible = key_pos[None, None, :] <= q_pos[:, :, None]  # (B, L, S)
    if sliding_window is not None:
        visible = visible & (key_pos[None, None, :] > q_pos[:, :, None] - sliding_window)
    scores = scores.masked_fill(~visible[:, None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(work).view(batch, n_kv, length * group, s)
    out = matmul(probs, v).view(batch, n_kv, length, group, head_dim)
    return out.permute(0, 2, 1, 3, 4).reshape(batch * length, n_heads * head_dim).to(q.dtype)


def attend_decode(
    q: torch.Tensor,            # (T, H, D)
    k_cache: torch.Tensor,      # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,
    token_idx: torch.Tensor,    # (B,) the one query token of each decoding sequence
    q_pos: torch.Tensor,        # (B,)
    block_table: torch.Tensor,  # (B, W)
    key_pos: torch.Tensor,      # (S,)
    scale: float,
    sliding_window: int | torch.Tensor | None,
    softcap: float | None = None,
    per_block: bool | None = None,  # P·V summed per block first; None: compile_policy's form for the device
) -> torch.Tensor:
    """attend() for one query per sequence, for the compiler; returns (B, H*D).

    Compiled, both products are reductions that read K and V straight from the cache through the block table
    inside the loop: nothing is gathered into a (B, Hkv, D, S) copy and no bmm is called. Block by block, keys
    outermost: K viewed (B, W, block_size, Hkv, D) through the table, scores (B, W, block_size, Hkv, G). The table
    is read once per block and each key's heads contiguously; every key of the table's blocks is read, those past
    the query masked (python -m benchmarks.attention; docs/benchmarks.md):
    - CPU: 0.51 ms a layer at batch 8, 200 keys (1.8 at batch 32), against 0.43 (1.9) for the slot cache, 0.79
      (3.8) with keys outermost through a per-key row, and 6.0 (22.6) with keys innermost, where Inductor
      vectorised along the keys and each lane went through the table.
    - CUDA (H100, CUDA graphs, 4 layers of the 1B model): 1.66 / 2.33 ms a step at batch 8 / 64 against 1.93 /
      3.29 with keys innermost through per-key rows (and 1.53 / 2.03 for the slot cache).
    On the CPU, P·V is summed per block first (16 keys, whose V stays in L1 while each of the G·D/8 vector lanes
    passes over it, where one sum over all keys re-reads a sequence's V that many times), and the exponentials are
    divided by their sum once, at the end: a batch-32 decode step at 400-token contexts 0.85-0.93x the time (paired
    processes), batch 8 within noise; a pool that fits the cache, within noise (docs/benchmarks.md). CUDA keeps
    its measured form (per_block=False).
    Eager would materialise the broadcast products: it calls attend()."""
    batch = token_idx.shape[0]
    n_heads, head_dim = q.shape[1], q.shape[2]
    n_kv = k_cache.shape[2]
    group = n_heads // n_kv
    width, bs = block_table.shape[1], k_cache.shape[1]
    pos = torch.arange(width * bs, device=q.device).view(width, bs)
    visible = pos[None] <= q_pos[:, None, None]  # (B, W, bs)
    if sliding_window is not None:
        visible = visible & (pos[None] > q_pos[:, None, None] - sliding_window)
    qb = q[token_idx].view(batch, 1, 1, n_kv, group, head_dim).float()
    k = k_cache[block_table][:, :, :, :, None, :]  # (B, W, bs, Hkv, 1, D): indexing, fused into the reduction
    scores = _softcap((qb * k.float()).sum(-1) * scale, softcap)  # (B, W, bs, Hkv, G)
    scores = scores.masked_fill(~visible[..., None, None], float("-inf"))
    v = v_cache[block_table].masked_fill(~visible[..., None, None], 0)  # stale: replaced, never multiplied
    if per_block is None:
        per_block = compile_policy.decode_attention_per_block(q.device)
    if per_block:
        exp = torch.exp(scores - scores.amax((1, 2), keepdim=True))  # the query's own key is visible: finite
        block_sums = (exp[..., None] * v[:, :, :, :, None, :].float()).sum(2)  # (B, W, Hkv, G, D)
        out = block_sums.sum(1) / exp.sum((1, 2))[..., None]
        return out.reshape(batch, n_heads * head_dim).to(q.dtype)
    probs = torch.softmax(scores.view(batch, width * bs, n_kv, group), dim=1).to(q.dtype)
    out = (probs.view(batch, width, bs, n_kv, group)[..., None] * v.to(q.dtype)[:, :, :, :, None, :]).sum((1, 2))
    return out.reshape(batch, n_heads * head_dim)  # (B, Hkv, G, D) -> (B, H*D)


def _softcap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    return scores if cap is None else torch.tanh(scores / cap) * cap


def attend_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata,
                   scale: float, sliding_window: int | torch.Tensor | None, compiled: bool,
                   softcap: float | None = None, sdpa: bool = False) -> torch.Tensor:
    """attend() over the step's prefill group. Compiled on CPU, a decode-only step skips it: its group is a padded
    placeholder (PLACEHOLDER_KEYS keys, where a real group reads more), and torch.cond on that size decides at run
    time, in the one graph. The placeholder's two bmm calls (each ~20 us of library set-up for 4608 multiply-adds)
    and its softmax cost 1-7 % of a batch-8 decode step (paired processes). On CUDA a decode step replays a graph,
    where they cost little, and the graphs' tested form stays."""
    args = (q, k_cache, v_cache, md.prefill_token_idx, md.prefill_q_pos, md.prefill_block_table, md.prefill_key_pos)
    # Derived once per step (AttentionMetadata.derive_prefill) where no layer has a window: operands too.
    derived = sdpa and sliding_window is None and md.prefill_mask is not None
    args += (md.prefill_kv_rows, md.prefill_mask) if derived else ()
    # A per-layer window tensor is an operand of torch.cond's branches, not a value they close over.
    window = isinstance(sliding_window, torch.Tensor)
    args += (sliding_window,) if window else ()
    cpu = compiled and q.device.type == "cpu"
    skip = compiled and compile_policy.skip_placeholder_prefill(q.device)

    def real(*tensors: torch.Tensor) -> torch.Tensor:
        # Compiled on CPU, float32 products: in bf16 oneDNN takes every bmm above 4096 multiply-adds at ~25 us a
        # call, which a mixed step's small chunks pay; 32 16-token prompts prefill within noise either way.
        tensors, w = (tensors[:-1], tensors[-1]) if window else (tensors, sliding_window)
        onednn = compile_policy.prefill_attention_onednn(tensors[0].device)
        if sdpa:
            q, k_cache, v_cache, token_idx, q_pos, block_table, key_pos, *given = tensors
            rows, mask = given if derived else (kv_rows(block_table, key_pos, k_cache.shape[1]), None)
            return sdpa_prefill(q, k_cache, v_cache, token_idx, q_pos, rows, key_pos, scale, w, mask,
                                compile_policy.prefill_attention_float32(q.device, compiled), onednn)
        return attend(*tensors, scale, w, float32=cpu, softcap=softcap, onednn=onednn)

    if not skip:
        return real(*args)

    def placeholder(q: torch.Tensor, _k, _v, token_idx: torch.Tensor, *_) -> torch.Tensor:
        return q.new_zeros(token_idx.numel(), q.shape[1] * q.shape[2])

    return torch.cond(md.prefill_key_pos.shape[0] > PLACEHOLDER_KEYS, real, placeholder, args)
