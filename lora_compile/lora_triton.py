"""CUDA's LoRA kernels in Triton (EngineConfig.lora_kernel "triton"): Punica's segmented shrink and expand over the
step's tokens sorted by slot, as vLLM's and SGLang's LoRA backends compute them, on our slot layout.

- shrink: h[t] = x[t] · A[slot(t)]ᵀ for every token of an adapter, (T, c·r). One program per (slot, run of
  BLOCK_M of its tokens, BLOCK_N of its rows); slot 0 (the base model) and runs past a slot's tokens return at
  once, so each adapter's A is read once per run of its tokens and no work is done for the others.
- expand: out[t] = base[t] + h[t, slice i] · B[slot(t)][:, slice i's columns] for every output column, the add to
  the base projection in the same kernel (float32 accumulation, one rounding). One program per (run of BLOCK_M
  tokens in slot order, BLOCK_N columns inside one slice); it loops over the few slots its run holds. B is the
  compact layout (max_rank, out): each slice's rank rows meet its own columns only, so no block-diagonal zeros are
  read.
Both are registered as torch custom ops with their Triton kernels visible to Inductor (torch.library.triton_op),
so the compiled layer calls them inside its one graph and a CUDA graph records them like any other kernel. The
grids depend on the (padded) token count only: nothing is read back to the host.

This module imports Triton: only CUDA engines load it (compile_policy.lora_kernel), never a CPU one.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

BLOCK_M = 16  # tokens a program takes: tl.dot's smallest tile; decode steps hold few tokens per adapter


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, h_ptr, order_ptr, ends_ptr, N, K,
                        stride_xm, stride_xk, stride_as, stride_an, stride_ak, stride_hm, stride_hn,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    slot = tl.program_id(0) + 1  # slot 0, the base model's, has no LoRA
    start = tl.load(ends_ptr + slot - 1)  # the slot's tokens are order[start:end]
    end = tl.load(ends_ptr + slot)
    m0 = start + tl.program_id(1) * BLOCK_M
    if m0 >= end:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    rows = tl.load(order_ptr + offs_m, mask=m_mask, other=0)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_ptr + slot * stride_as + offs_n[None, :] * stride_an + offs_k[:, None] * stride_ak,
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if IEEE:  # float32 engines: full-precision products, as the reference computes them (no TF32)
            acc += tl.dot(x, a, input_precision="ieee")
        else:
            acc += tl.dot(x, a)
    tl.store(h_ptr + rows[:, None] * stride_hm + offs_n[None, :] * stride_hn, acc.to(h_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _lora_expand_kernel(h_ptr, b_ptr, base_ptr, out_ptr, order_ptr, slot_ptr, offsets_ptr, T, OUT, R,
                        stride_hm, stride_hn, stride_bs, stride_br, stride_bn, stride_base_m, stride_base_n,
                        stride_om, stride_on,
                        NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_R: tl.constexpr, IEEE: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < T
    rows = tl.load(order_ptr + offs_m, mask=m_mask, other=0)
    slots = tl.load(slot_ptr + rows, mask=m_mask, other=0)
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < OUT
    # The slice these columns belong to (BLOCK_N divides every slice: a run of columns never straddles two).
    piece = 0
    for j in tl.static_range(1, NUM_SLICES):
        piece += (n0 >= tl.load(offsets_ptr + j)).to(tl.int32)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    # Tokens are in slot order: this run holds slots first..last (sorted, so every one between them may occur).
    first = tl.min(tl.where(m_mask, slots, 1 << 30), axis=0)
    last = tl.max(tl.where(m_mask, slots, 0), axis=0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for slot in range(tl.maximum(first, 1), last + 1):
        own = m_mask & (slots == slot)
        h = tl.load(h_ptr + rows[:, None] * stride_hm + (piece * R + offs_r)[None, :] * stride_hn,
                    mask=own[:, None] & r_mask[None, :], other=0.0)
        b = tl.load(b_ptr + slot * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn,
                    mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(h, b, input_precision="ieee")
        else:
            acc += tl.dot(h, b)
    mask = m_mask[:, None] & n_mask[None, :]
    base = tl.load(base_ptr + rows[:, None] * stride_base_m + offs_n[None, :] * stride_base_n, mask=mask, other=0.0)
    tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on,
             (base.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=mask)


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << (max(n, 1) - 1).bit_length())


def expand_block_n(slice_sizes: tuple[int, ...]) -> int:
    """Output columns an expand program takes: the largest power of two up to 128 that divides every slice (so a
    program's columns lie in one slice); 0 where none of 16 or more does (the layer cannot take this kernel)."""
    for block in (128, 64, 32, 16):
        if all(size % block == 0 for size in slice_sizes):
            return block
    return 0


@triton_op("lora_serve::lora_shrink", mutates_args=())
def lora_shrink(x: torch.Tensor, a: torch.Tensor, order: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """(T, N) shrink of every token whose slot is >= 1: x (T, K), a (S, N, K) every slot's A rows, order (T,) the
    tokens sorted by slot, ends (S,) where each slot's run in `order` ends. Rows of slot-0 tokens are left unset
    (lora_expand never reads them)."""
    tokens, k = x.shape
    slots, n, _ = a.shape
    h = x.new_empty(tokens, n)
    # Rows of A in runs of 16, a program each: a decode step's few tokens per adapter leave the GPU idle unless
    # each adapter's A is read by several programs (one program per adapter took 8-19 us a projection, H200).
    block_n = 16
    block_k = 256 if k >= 4096 else 128
    grid = (slots - 1, triton.cdiv(tokens, BLOCK_M), triton.cdiv(n, block_n))
    wrap_triton(_lora_shrink_kernel)[grid](
        x, a, h, order, ends, n, k, x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2),
        h.stride(0), h.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        IEEE=x.dtype == torch.float32, num_warps=4, num_stages=3)
    return h


@triton_op("lora_serve::lora_expand", mutates_args=())
def lora_expand(h: torch.Tensor, b: torch.Tensor, base: torch.Tensor, order: torch.Tensor, slot: torch.Tensor,
                offsets: torch.Tensor, block_n: int) -> torch.Tensor:
    """base + each token's LoRA delta, (T, out): h (T, c·R) from lora_shrink, b (S, R, out) every slot's B with
    each slice in its own columns, base (T, out), order / slot (T,) the tokens in slot order and each token's slot,
    offsets (c + 1,) where each slice's columns start, block_n expand_block_n's choice for this layer."""
    tokens, out_features = base.shape
    rank = b.shape[1]
    out = base.new_empty(tokens, out_features)
    grid = (triton.cdiv(tokens, BLOCK_M), triton.cdiv(out_features, block_n))
    wrap_triton(_lora_expand_kernel)[grid](
        h, b, base, out, order, slot, offsets, tokens, out_features, rank,
        h.stride(0), h.stride(1), b.stride(0), b.stride(1), b.stride(2), base.stride(0), base.stride(1),
        out.stride(0), out.stride(1),
        NUM_SLICES=offsets.shape[0] - 1, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_R=_pow2_at_least(rank, 16),
        IEEE=base.dtype == torch.float32, num_warps=4, num_stages=2)
    return out
