"""Overlapped batch init (lora_compile.core.step_ahead): a decode step built while the step before it ran gives exactly the
tokens of the same step built in turn, through joins, finishes by length and by stop token, cancellations and
preemption; a build that no longer fits its step is dropped, never used. On by default on CUDA only (the device
runs while the host builds); switched on here on the CPU, where the same code runs after the forward."""
from __future__ import annotations

import random

import torch

from lora_compile import SamplingParams, Sequence
from lora_compile.config import ModelConfig
from lora_compile.kv_cache.sizing import bytes_per_block
from tests.conftest import build_engine
from tests.test_engine_golden import PROMPTS, assert_matches_reference, run_joining
from tests.test_lora import MIXED


def test_built_ahead_steps_match_peft(models, adapters):
    """Decode steps taken from builds made ahead: transformers + peft's greedy tokens, base and adapters mixed,
    sequences joining at different steps."""
    engine = build_engine(models["llama"], adapters["llama"], compile=False, overlap_batch_init=True,
                          merge_lone_adapter="off")  # (merging decides per step: no build ahead with it)
    tokens, logits = run_joining(engine, PROMPTS, adapters=MIXED, join_at=[0, 0, 1, 2])
    assert engine.ahead.hits > 20
    assert_matches_reference(models["llama"], PROMPTS, tokens, logits,
                             [adapters["llama"][n] if n else None for n in MIXED])


def _workload(engine, seed: int) -> dict[int, list[int]]:
    """Random arrivals, prompt lengths, budgets, stop tokens, seeded sampling and adapters; every fifth sequence is
    cancelled mid-way. Returns each sequence's tokens."""
    rng = random.Random(seed)
    names = [None, "qv8", "all4", "mlp16rs"]
    running: list[Sequence] = []
    waiting: list[Sequence] = []
    outputs: dict[int, list[int]] = {}
    for i in range(40):
        prompt = [rng.randrange(3, 300) for _ in range(rng.randrange(2, 60))]
        sp = SamplingParams(max_new_tokens=rng.randrange(1, 60), temperature=rng.choice([0.0, 1.0]), seed=i,
                            stop_token_ids=[rng.randrange(3, 300) for _ in range(5)], ignore_eos=True)
        waiting.append(Sequence(i, prompt, sp, rng.choice(names)))
    step = 0
    while waiting or running:
        while waiting and rng.random() < 0.4 and engine.try_admit(waiting[0]):
            running.append(waiting.pop(0))
        if not running:
            assert engine.try_admit(waiting[0]), "a lone sequence does not fit"
            running.append(waiting.pop(0))
        out = engine.step(running)
        for seq_id in out.preempted:  # back in line, first
            seq = next(s for s in running if s.seq_id == seq_id)
            running.remove(seq)
            waiting.insert(0, seq)
        step += 1
        for seq in list(running):
            if seq.seq_id % 5 == 0 and len(seq.output_ids) == 3:  # cancelled by its client
                seq.finish_reason = "abort"
            if seq.finish_reason:
                outputs[seq.seq_id] = list(seq.output_ids)
                engine.release(seq)
                running.remove(seq)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    return outputs


def test_built_ahead_steps_equal_steps_built_in_turn(models, adapters):
    """The same random workload (seeded sampling included) with and without builds made ahead, on a KV pool small
    enough to preempt: the same tokens for every sequence, every block back in the pool; builds were taken, and
    dropped where the batch changed."""
    per_block = bytes_per_block(ModelConfig.from_dir(models["llama"]), 16, torch.float32)
    kw = dict(compile=False, kv_cache_memory=15 * per_block, max_num_seqs=6, merge_lone_adapter="off")  # 14 blocks: 6 sequences preempt
    results = {}
    for overlap in (False, True):
        engine = build_engine(models["llama"], adapters["llama"], overlap_batch_init=overlap, **kw)
        results[overlap] = _workload(engine, seed=3)
        if overlap:
            assert engine.ahead.hits > 50 and engine.ahead.misses > 5
            preemptions = engine.num_preemptions
    assert results[True] == results[False]
    assert len(results[True]) == 40 and preemptions > 0
