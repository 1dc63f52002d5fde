"""Why compiled decode attention is written as two reductions, block by block, reading K/V through block tables:
one layer's decode attention, with the rotary embedding of its queries, compiled as the engine compiles it (sizes
dynamic, traced at a small step), in the form the engine uses (lora_compile.model.attention.attend_decode) and in the forms
it replaced, side by side.

    python -m benchmarks.attention [--batches 8 32] [--keys 80 200] [--rounds 7] [--device cuda --shape llama-1b]
                                   [--no-compile]

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64) or Llama-3.2-1B's (32, 8, 64), float32 on
the CPU and bfloat16 on CUDA. The same K/V held two ways: as the slot cache before paging (33 slots x 256 positions, each sequence in its own shuffled slot) and as a paged
pool of 16-token blocks (the same blocks, shuffled; each sequence's block table lists its). Each sequence reads
`keys` cached positions. The bmm form gathers every sequence's K into a (B, Hkv, D, S) copy and V into
(B, Hkv, S, D) before two bmm calls; the reduction forms read both inside Inductor's loops, with scores laid out
(B, W, block_size, Hkv, G) (blocks outermost, the table read once per block: the engine's),
(B, S, Hkv, G) (keys outermost through a per-key row) or (B, Hkv, G, S) (keys innermost: CUDA's before); on
the CPU the engine sums P·V per block before summing the blocks, "one P·V sum" is its form on CUDA. "slots"
is the engine's form before paging (K/V read by slot: `k_cache[kv_slots, :s]`). On the CPU, "bfloat16 pool" is
the engine's form over the same values held in a bfloat16 pool (--kv-cache-dtype bfloat16), float32 queries.
Prints microseconds per call (medians of interleaved rounds). On CUDA these are eager calls of compiled
functions, launch-bound at these sizes (170-260 us whatever the form on an H100): there the decode step with CUDA
graphs decides (docs/benchmarks.md).
Batches up to 32 (the slot cache's 33 slots).
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.common import interleaved, per_call_us
from lora_compile import compile_policy
from lora_compile.model.layers import apply_rotary
from lora_compile.model.attention import attend, attend_decode, kv_rows

HKV, GROUP, HEAD_DIM, SLOTS, MAX_LEN, BLOCK = 3, 3, 64, 33, 256, 16


def keys_outermost(q, k_cache, v_cache, token_idx, q_pos, block_table, key_pos, scale, window, *_):
    """Keys outermost through a per-key cache row (kv_rows): scores (B, S, Hkv, G)."""
    batch = token_idx.shape[0]
    rows = kv_rows(block_table, key_pos, k_cache.shape[1])
    qb = q[token_idx].view(batch, 1, HKV, GROUP, HEAD_DIM).float()
    scores = (qb * k_cache.view(-1, HKV, HEAD_DIM)[rows][:, :, :, None, :].float()).sum(-1) * scale
    visible = key_pos[None, :] <= q_pos[:, None]
    probs = torch.softmax(scores.masked_fill(~visible[:, :, None, None], float("-inf")), dim=1).to(q.dtype)
    v = v_cache.view(-1, HKV, HEAD_DIM)[rows].masked_fill(~visible[:, :, None, None], 0)
    return (probs[..., None] * v[:, :, :, None, :]).sum(1).reshape(batch, HKV * GROUP * HEAD_DIM)


def slots(q, _k, _v, token_idx, q_pos, _table, key_pos, scale, window, slot_k, slot_v, kv_slots):
    """The engine's decode attention before paging: K/V read from each sequence's slot."""
    batch, s = token_idx.shape[0], key_pos.shape[0]
    qb = q[token_idx].view(batch, HKV, GROUP, 1, HEAD_DIM).float()
    k = slot_k[kv_slots, :s].permute(0, 2, 1, 3)[:, :, None]
    scores = (qb * k.float()).sum(-1) * scale
    visible = key_pos[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    v = slot_v[kv_slots, :s].masked_fill(~visible[:, :, None, None], 0)
    out = (probs[..., None] * v.permute(0, 2, 1, 3)[:, :, None]).sum(3)
    return out.reshape(batch, HKV * GROUP * HEAD_DIM)


def bmm_form(q, k_cache, v_cache, token_idx, q_pos, block_table, key_pos, scale, window, *_):
    return attend(q, k_cache, v_cache, token_idx[:, None], q_pos[:, None], block_table, key_pos, scale, window)


def engine_form(*args):
    return attend_decode(*args[:9])


def one_sum(*args):
    """The engine's form as CUDA runs it (and the CPU did before): P·V summed over all keys at once, the
    probabilities normalised first."""
    return attend_decode(*args[:9], per_block=False)


def keys_innermost(q, k_cache, v_cache, token_idx, q_pos, block_table, key_pos, scale, window, *_):
    """attend_decode before: scores (B, Hkv, G, S), keys contiguous, each through its cache row."""
    batch = token_idx.shape[0]
    rows = kv_rows(block_table, key_pos, k_cache.shape[1])
    qb = q[token_idx].view(batch, HKV, GROUP, 1, HEAD_DIM).float()
    k = k_cache.view(-1, HKV, HEAD_DIM)[rows].permute(0, 2, 1, 3)[:, :, None]
    scores = (qb * k.float()).sum(-1) * scale
    visible = key_pos[None, :] <= q_pos[:, None]
    probs = torch.softmax(scores.masked_fill(~visible[:, None, None, :], float("-inf")), dim=-1).to(q.dtype)
    v = v_cache.view(-1, HKV, HEAD_DIM)[rows].masked_fill(~visible[:, :, None, None], 0)
    out = (probs[..., None] * v.permute(0, 2, 1, 3)[:, :, None]).sum(3)
    return out.reshape(batch, HKV * GROUP * HEAD_DIM)


FORMS = {"paged, blocks outermost (engine)": engine_form, "paged, blocks outermost, one P·V sum": one_sum,
         "slots, keys innermost (before paging)": slots,
         "paged, keys outermost, per-key rows": keys_outermost, "paged, keys innermost": keys_innermost,
         "paged, gather + bmm": bmm_form}
SHAPES = {"smollm2-135m": (3, 3, 64), "llama-1b": (8, 4, 64)}  # (Hkv, group, head_dim)
# The engine's form over a bfloat16 pool, float32 queries (--kv-cache-dtype bfloat16 with a float32 model; CPU).
BF16_POOL = "paged, engine, bfloat16 pool"


def form_pool_dtype(form: str) -> torch.dtype | None:
    """The pools' dtype a form reads (None: the queries' dtype)."""
    return torch.bfloat16 if form == BF16_POOL else None


def make_inputs(batch: int, keys: int, gen: torch.Generator, device: str = "cpu", dtype=torch.float32,
                pool_dtype: torch.dtype | None = None):
    slot_k = torch.randn(SLOTS, MAX_LEN, HKV, HEAD_DIM, generator=gen)
    slot_v = torch.randn(SLOTS, MAX_LEN, HKV, HEAD_DIM, generator=gen)
    per_slot = MAX_LEN // BLOCK
    # The same blocks in a shuffled pool: pool block perm[i] holds slot block i.
    perm = torch.randperm(SLOTS * per_slot, generator=gen)
    k_pool, v_pool = torch.empty(SLOTS * per_slot, BLOCK, HKV, HEAD_DIM), torch.empty(SLOTS * per_slot, BLOCK, HKV, HEAD_DIM)
    k_pool[perm], v_pool[perm] = slot_k.view(-1, BLOCK, HKV, HEAD_DIM), slot_v.view(-1, BLOCK, HKV, HEAD_DIM)
    q = torch.randn(batch + 1, HKV * GROUP, HEAD_DIM, generator=gen)  # + the step's dummy token
    cos, sin = torch.randn(batch + 1, HEAD_DIM, generator=gen), torch.randn(batch + 1, HEAD_DIM, generator=gen)
    token_idx = torch.arange(batch)
    q_pos = torch.full((batch,), keys - 1)
    kv_slots = torch.randperm(SLOTS - 1, generator=gen)[:batch]
    width = max(2, -(-keys // BLOCK))
    block_table = perm.view(SLOTS, per_slot)[kv_slots, :width].contiguous()
    key_pos = torch.arange(keys)
    args = tuple(a.to(device, dtype if a.is_floating_point() else a.dtype) if isinstance(a, torch.Tensor) else a
                 for a in (q, cos, sin, k_pool, v_pool, token_idx, q_pos, block_table, key_pos, HEAD_DIM ** -0.5, None,
                           slot_k, slot_v, kv_slots))
    if pool_dtype is not None:  # the paged pools only (K, V)
        args = args[:3] + (args[3].to(pool_dtype), args[4].to(pool_dtype)) + args[5:]
    for i, dims in ((0, (0,)), (1, (0,)), (2, (0,)), (5, (0,)), (6, (0,)), (7, (0, 1)), (8, (0,)), (13, (0,))):
        for d in dims:  # the engine's step-varying dims
            torch._dynamo.mark_dynamic(args[i], d)
    return args


def with_rotary(form):
    """The form after the queries' rotary embedding, as in the layer (Inductor fuses the two)."""
    def layer_attention(q, cos, sin, *rest):
        return form(apply_rotary(q, cos, sin), *rest)
    return layer_attention


def compiled_forms(device: str, dtype, compile: bool = True) -> dict:
    """Each form compiled once, traced at a small step (3 sequences, 8 keys) as the engine's warm-up traces (compile
    false: the forms eagerly, a check that they run and agree)."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(1)
    forms = {}
    bf16_pool = {BF16_POOL: engine_form} if dtype == torch.float32 else {}
    for name, form in {**FORMS, **bf16_pool}.items():
        forms[name] = torch.compile(with_rotary(form), fullgraph=True) if compile else with_rotary(form)
        forms[name](*make_inputs(3, 8, gen, device, dtype, form_pool_dtype(name)))
    return forms


def measure(forms: dict, batch: int, keys: int, rounds: int, device: str, dtype) -> None:
    # The same values in every pool (a bfloat16 pool holds them rounded); each form against the bmm form over its own.
    args = {pool: make_inputs(batch, keys, torch.Generator().manual_seed(0), device, dtype, pool)
            for pool in {form_pool_dtype(name) for name in forms}}
    references = {pool: with_rotary(bmm_form)(*pool_args) for pool, pool_args in args.items()}
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, fn in forms.items():
        pool = form_pool_dtype(name)
        torch.testing.assert_close(fn(*args[pool]), references[pool], atol=tol, rtol=tol)
    calls = 200
    sync = torch.cuda.synchronize if device == "cuda" else None
    us = interleaved({name: per_call_us(lambda fn=fn, a=args[form_pool_dtype(name)]: fn(*a), calls, sync)
                      for name, fn in forms.items()}, rounds)
    print(f"\nbatch {batch}, {keys} keys: us per call")
    for name, value in us.items():
        print(f"  {name:38s} {value:8.1f}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    p.add_argument("--keys", type=int, nargs="+", default=[80, 200])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: bfloat16 K/V, as the engine")
    p.add_argument("--shape", choices=list(SHAPES), default="smollm2-135m")
    p.add_argument("--no-compile", action="store_true",
                   help="the forms eagerly (a check that they run: Inductor's code is what is measured)")
    args = p.parse_args()
    global HKV, GROUP, HEAD_DIM
    HKV, GROUP, HEAD_DIM = SHAPES[args.shape]
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    print(f"torch {torch.__version__}, {args.device}, {args.shape}, {torch.get_num_threads()} threads")
    compile_policy.configure(None)  # the engine's Inductor settings
    with torch.no_grad():
        forms = compiled_forms(args.device, dtype, not args.no_compile)
        for batch in args.batches:
            for keys in args.keys:
                measure(forms, batch, keys, args.rounds, args.device, dtype)


if __name__ == "__main__":
    main()
