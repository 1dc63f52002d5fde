"""Attention through block tables: the compiled decode form (reductions over the paged cache), the bmm form that
eager and prefill use, and torch's scaled_dot_product_attention over gathered K/V (attention_sdpa, CUDA's), against
dense attention over each sequence's own keys."""
from __future__ import annotations

import random

import pytest
import torch

from lora_compile.model.attention_sdpa import sdpa_decode, sdpa_prefill
from lora_compile.model.attention import attend, attend_decode, kv_rows


def _per_block(*args):
    return attend_decode(*args, per_block=True)


def _one_sum(*args):
    return attend_decode(*args, per_block=False)


# One compiled function per form for every case: dynamic shapes, so block sizes and lengths reuse its graphs (two
# functions, not one with a flag: each has its own code object, so the two forms do not share Dynamo's
# recompile limit).
_COMPILED = {per_block: torch.compile(fn, fullgraph=True, dynamic=True)
             for per_block, fn in ((True, _per_block), (False, _one_sum))}
_SDPA_DECODE = torch.compile(sdpa_decode, fullgraph=True, dynamic=True)


def _paged(seq_keys: list[torch.Tensor], block_size: int, num_blocks: int, rng: random.Random):
    """A pool holding each sequence's (len, Hkv, D) rows in shuffled blocks, every other row NaN (stale data that
    must never reach a result), and the block tables, padded with the null block 0."""
    n_kv, head_dim = seq_keys[0].shape[1:]
    pool = torch.full((num_blocks, block_size, n_kv, head_dim), float("nan"))
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = []
    for keys in seq_keys:
        blocks = [free.pop() for _ in range(-(-keys.shape[0] // block_size))]
        for i, b in enumerate(blocks):
            rows = keys[i * block_size:(i + 1) * block_size]
            pool[b, :rows.shape[0]] = rows
        tables.append(blocks)
    width = max(2, max(len(t) for t in tables))
    return pool, torch.tensor([t + [0] * (width - len(t)) for t in tables])


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, window: int | None) -> torch.Tensor:
    """One query at `pos` over keys 0..pos of one sequence (grouped-query heads), the plain formula."""
    group = q.shape[0] // k.shape[1]
    first = 0 if window is None else max(0, pos - window + 1)
    k, v = k[first:pos + 1].repeat_interleave(group, 1), v[first:pos + 1].repeat_interleave(group, 1)
    probs = torch.softmax(torch.einsum("hd,shd->hs", q, k) * q.shape[-1] ** -0.5, dim=-1)
    return torch.einsum("hs,shd->hd", probs, v).reshape(-1)


# (block size, pool dtype, form): the CPU's form (per block) at every size; CUDA's (one sum) at a small block size
# and the default one (one compiled graph: the sizes are dynamic).
_CASES = [(1, torch.float32, True), (3, torch.float32, True), (4, torch.float32, True), (16, torch.float32, True),
          (3, torch.bfloat16, True), (16, torch.bfloat16, True), (3, torch.float32, False), (16, torch.float32, False)]


@pytest.mark.parametrize("block_size,kv_dtype,per_block", _CASES,
                         ids=["1", "3", "4", "16", "3-bf16-cache", "16-bf16-cache", "3-one-sum", "16-one-sum"])
@pytest.mark.parametrize("window", [None, 5], ids=["full", "sliding-window"])
def test_decode_attention_reads_through_block_tables(window, block_size, kv_dtype, per_block):
    """bf16-cache: float32 queries over a bfloat16 pool (--kv-cache-dtype bfloat16), computed in float32: exactly
    the float32 result over the rounded keys and values. per-block: the CPU's form (P·V summed per block, divided
    once); one-sum: CUDA's, both run here."""
    rng, gen = random.Random(block_size), torch.Generator().manual_seed(block_size)
    n_kv, group, head_dim = 2, 3, 8
    # Four sequences at positions across block edges, their query tokens not in order.
    positions = [12, 0, 7, block_size * 2 - 1]
    lengths = [p + 1 for p in positions]
    k_seq = [torch.randn(n, n_kv, head_dim, generator=gen).to(kv_dtype).float() for n in lengths]
    v_seq = [torch.randn(n, n_kv, head_dim, generator=gen).to(kv_dtype).float() for n in lengths]
    num_blocks = 1 + sum(-(-n // block_size) for n in lengths) + 3
    k_cache, table = _paged(k_seq, block_size, num_blocks, random.Random(rng.random()))
    v_cache, table_v = _paged(v_seq, block_size, num_blocks, random.Random(rng.random()))
    v_cache = v_cache.view(-1, n_kv, head_dim)[_remap(table_v, table, block_size, num_blocks)].view_as(v_cache)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    q = torch.randn(6, n_kv * group, head_dim, generator=gen)
    token_idx = torch.tensor([3, 0, 5, 1])
    q_pos = torch.tensor(positions)
    key_pos = torch.arange(max(lengths))
    expected = torch.stack([_dense(q[t], k_seq[i], v_seq[i], positions[i], window)
                            for i, t in enumerate(token_idx.tolist())])
    args = (q, k_cache, v_cache, token_idx, q_pos, table, key_pos, head_dim ** -0.5, window)
    bmm = attend(q, k_cache, v_cache, token_idx[:, None], q_pos[:, None], table, key_pos, head_dim ** -0.5, window)
    torch.testing.assert_close(bmm, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(attend_decode(*args, per_block=per_block), expected, atol=1e-5, rtol=1e-5)
    compiled = _COMPILED[per_block](*args)
    torch.testing.assert_close(compiled, expected, atol=1e-5, rtol=1e-5)
    assert bmm.dtype == compiled.dtype == torch.float32
    # The SDPA form reads every key of the table's blocks (the decode group's key_pos), stale rows masked.
    rows = kv_rows(table, torch.arange(table.shape[1] * block_size), block_size)
    sdpa_args = (q, k_cache, v_cache, token_idx, q_pos, rows, head_dim ** -0.5, window)
    torch.testing.assert_close(sdpa_decode(*sdpa_args), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_SDPA_DECODE(*sdpa_args), expected, atol=1e-5, rtol=1e-5)


def _remap(table_from: torch.Tensor, table_to: torch.Tensor, block_size: int, num_blocks: int) -> torch.Tensor:
    """Row permutation that moves V's blocks to where K's blocks of the same positions are, so one table reads
    both (the layers keep K and V at the same rows)."""
    rows = torch.arange(num_blocks * block_size)
    for src_row, dst_row in zip(table_from.tolist(), table_to.tolist()):
        for src, dst in zip(src_row, dst_row):
            if dst:
                rows[dst * block_size:(dst + 1) * block_size] = torch.arange(src * block_size, (src + 1) * block_size)
    return rows


def test_prefill_attention_reads_its_own_chunk_and_cached_prefix():
    """A chunk of queries at positions 5..9 over keys 0..9 in blocks of 4: causal within the chunk, the prefix
    from earlier blocks, stale rows of its last block never read."""
    gen = torch.Generator().manual_seed(1)
    n_kv, group, head_dim, bs = 1, 2, 4, 4
    k = torch.randn(10, n_kv, head_dim, generator=gen)
    v = torch.randn(10, n_kv, head_dim, generator=gen)
    k_cache, table = _paged([k], bs, 8, random.Random(0))
    v_cache = torch.full_like(k_cache, float("nan"))
    v_cache.view(-1, n_kv, head_dim)[(table[0, torch.arange(10) // bs] * bs + torch.arange(10) % bs)] = v
    q = torch.randn(5, n_kv * group, head_dim, generator=gen)
    pos = torch.arange(5, 10)
    out = attend(q, k_cache, v_cache, torch.arange(5)[None], pos[None], table, torch.arange(12), head_dim ** -0.5,
                 None)
    expected = torch.stack([_dense(q[i], k, v, int(pos[i]), None) for i in range(5)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    key_pos = torch.arange(12)
    sdpa = sdpa_prefill(q, k_cache, v_cache, torch.arange(5)[None], pos[None], kv_rows(table, key_pos, bs), key_pos,
                        head_dim ** -0.5, None)
    torch.testing.assert_close(sdpa, expected, atol=1e-5, rtol=1e-5)


def test_float32_prompt_attention_through_onednn_stays_float32():
    """Where compile_policy routes prompt attention's float32 products to oneDNN (not MKL's sgemm), they stay
    float32: the flash kernel's and the bmm form's, within float32's bound against float64 for operands bfloat16
    does not hold (in bfloat16 ~1e-2 off), and the setting that routes them is restored after each call."""
    from lora_compile import compile_policy
    from lora_compile.model import onednn_float32
    from lora_compile.model.attention_sdpa import prefill_mask

    if not compile_policy.prefill_attention_onednn(torch.device("cpu")):
        pytest.skip("oneDNN would compute these float32 products in bfloat16 on this CPU: MKL keeps them")
    gen = torch.Generator().manual_seed(3)
    n_kv, group, head_dim, length, keys = 3, 3, 64, 96, 160
    q = torch.randn(1, n_kv, length * group, head_dim, generator=gen)
    k, v = (torch.randn(1, n_kv, keys, head_dim, generator=gen) for _ in range(2))
    visible = prefill_mask(torch.arange(keys - length, keys)[None], torch.arange(keys), group, None)
    mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))
    reference = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                                 attn_mask=mask.double(), scale=0.125)
    before = torch.backends.mkldnn.matmul.fp32_precision
    out = onednn_float32.sdpa(q, k, v, mask, 0.125)
    assert torch.backends.mkldnn.matmul.fp32_precision == before
    assert out.dtype == torch.float32 and (out.double() - reference).abs().max() < 2e-6
    scores = onednn_float32.matmul(q, k.transpose(2, 3))
    assert torch.backends.mkldnn.matmul.fp32_precision == before
    exact = q.double() @ k.double().transpose(2, 3)
    assert scores.shape == exact.shape and ((scores.double() - exact).abs() / exact.abs().amax()).max() < 1e-6
