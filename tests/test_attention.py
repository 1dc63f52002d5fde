"""Compiled decode attention (reductions over the cache) against the bmm form that eager and prefill use."""
from __future__ import annotations

import pytest
import torch

from lora_compile.model import attend, attend_decode


@pytest.mark.parametrize("window", [None, 5], ids=["full", "sliding-window"])
def test_compiled_decode_attention_matches_bmm_form(window):
    gen = torch.Generator().manual_seed(0)
    n_kv, group, head_dim, slots, max_len = 2, 3, 8, 7, 32
    k_cache = torch.randn(slots, max_len, n_kv, head_dim, generator=gen)
    v_cache = torch.randn(slots, max_len, n_kv, head_dim, generator=gen)
    q = torch.randn(6, n_kv * group, head_dim, generator=gen)
    # Four sequences at different positions, in shuffled slots, their query tokens not in order; keys 0..12 are
    # read, so the shorter sequences' later keys (other data in the cache) must be masked out.
    token_idx = torch.tensor([3, 0, 5, 1])
    q_pos = torch.tensor([12, 0, 7, 3])
    kv_slots = torch.tensor([4, 1, 6, 2])
    key_pos = torch.arange(13)
    args = (q, k_cache, v_cache, token_idx, q_pos, kv_slots, key_pos, head_dim ** -0.5, window)

    expected = attend(q, k_cache, v_cache, token_idx[:, None], q_pos[:, None], kv_slots, key_pos,
                      head_dim ** -0.5, window)
    torch.testing.assert_close(attend_decode(*args), expected)  # uncompiled: the same reductions, run eagerly
    compiled = torch.compile(attend_decode, fullgraph=True)(*args)
    torch.testing.assert_close(compiled, expected, atol=1e-5, rtol=1e-5)
    # The inputs make the mask matter: without it the result would differ.
    unmasked = attend(q, k_cache, v_cache, token_idx[:, None], torch.full((4, 1), 12), kv_slots, key_pos,
                      head_dim ** -0.5, None)
    assert not torch.allclose(unmasked, expected, atol=1e-3)
