"""Why compiled decode attention is written as two reductions: one layer's decode attention, compiled, in the form
the engine uses (lora_compile.model.attend_decode) and in the bmm form it replaced (attend), side by side.

    python -m benchmarks.attention [--batches 8 32] [--keys 80 200] [--rounds 7]

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64), float32, a KV cache of 33 slots x 256
positions; each sequence reads `keys` cached positions from its own (shuffled) slot. The bmm form gathers every
sequence's K into a (B, Hkv, D, S) copy and V into (B, Hkv, S, D) before two bmm calls; the reduction form reads
both from the cache by slot inside Inductor's loops. Prints microseconds per call (medians of interleaved rounds).
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.common import interleaved, per_call_us
from lora_compile.model import attend, attend_decode

HKV, GROUP, HEAD_DIM, SLOTS, MAX_LEN = 3, 3, 64, 33, 256


def measure(batch: int, keys: int, rounds: int) -> None:
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(SLOTS, MAX_LEN, HKV, HEAD_DIM, generator=gen)
    v_cache = torch.randn(SLOTS, MAX_LEN, HKV, HEAD_DIM, generator=gen)
    q = torch.randn(batch + 1, HKV * GROUP, HEAD_DIM, generator=gen)
    token_idx = torch.arange(batch)
    q_pos = torch.full((batch,), keys - 1)
    kv_slots = torch.randperm(SLOTS - 1, generator=gen)[:batch]
    key_pos = torch.arange(keys)
    args = (q, k_cache, v_cache, token_idx, q_pos, kv_slots, key_pos, HEAD_DIM ** -0.5, None)

    def bmm_form(q, k_cache, v_cache, token_idx, q_pos, kv_slots, key_pos, scale, window):
        return attend(q, k_cache, v_cache, token_idx[:, None], q_pos[:, None], kv_slots, key_pos, scale, window)

    forms = {"reductions (engine)": torch.compile(attend_decode, fullgraph=True),
             "gather + bmm (before)": torch.compile(bmm_form, fullgraph=True)}
    reference = bmm_form(*args)
    for fn in forms.values():
        torch.testing.assert_close(fn(*args), reference, atol=1e-5, rtol=1e-5)
    calls = 200
    us = interleaved({name: per_call_us(lambda fn=fn: fn(*args), calls) for name, fn in forms.items()}, rounds)
    print(f"\nbatch {batch}, {keys} keys: us per call")
    for name, value in us.items():
        print(f"  {name:24s} {value:8.1f}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    p.add_argument("--keys", type=int, nargs="+", default=[80, 200])
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    with torch.no_grad():
        for batch in args.batches:
            for keys in args.keys:
                measure(batch, keys, args.rounds)


if __name__ == "__main__":
    main()
