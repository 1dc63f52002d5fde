"""The paged KV cache: blocks, prefix hits keyed by whose weights computed them, preemption, and no leaks.

Token-for-token against transformers + PEFT where tokens matter; the block-table fuzz compares the paged engine
with itself unpaged-equivalent (one block per sequence, no caching), which the golden tests tie to transformers."""
from __future__ import annotations

import random
import shutil

import pytest

from lora_compile import SamplingParams, Sequence
from lora_compile.kv_cache import BlockPool, block_hashes, root_hash
from tests.checkpoints import make_peft_adapter, reference_greedy
from tests.conftest import ADAPTER_SPECS, build_engine

NEW = 8
GREEDY = SamplingParams(max_new_tokens=NEW, ignore_eos=True)


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def _idle(engine) -> None:
    assert engine.num_running == 0
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks, "a KV block leaked"
    assert engine.kv_cache.usage == 0.0


# --- the pool and the hashes ---------------------------------------------------------------------------

def test_freed_blocks_stay_findable_until_taken_least_recently_freed_first():
    pool = BlockPool(4)
    a, b = pool.take(2)
    pool.cache(a, b"ha")
    pool.cache(b, b"hb")
    pool.free([b, a])  # b freed first: evicted first
    assert pool.num_free == 4 and pool.lookup([b"ha", b"hb"]) == [a, b]
    pool.take(2)  # the two never-used blocks
    (taken,) = pool.take(1)
    assert taken == b and pool.lookup([b"hb"]) == [] and pool.lookup([b"ha"]) == [a]
    pool.touch([a])
    assert pool.num_free == 0 and pool.ref_cnt[a] == 1


def test_hashes_chain_from_whose_weights_computed_them():
    tokens = list(range(40))
    base, other = root_hash(b"base-model"), root_hash(b"adapter\0a\0" + bytes(32))
    h = block_hashes(base, tokens, 16)
    assert len(h) == 2 and len(set(h)) == 2
    assert block_hashes(base, tokens[:16] + [99] * 16, 16)[0] == h[0]  # same first block
    assert block_hashes(base, tokens[:16] + [99] * 16, 16)[1] != h[1]
    assert set(block_hashes(other, tokens, 16)).isdisjoint(h)  # another root: nothing in common


# --- through the engine ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(models, adapters):
    return build_engine(models["llama"], adapters["llama"], compile=False, block_size=4, max_seq_len=96)


@pytest.mark.parametrize("kind", ["eager", "compiled"])
def test_same_long_prompt_to_base_and_two_adapters_then_again_hits_and_stays_exact(request, models, adapters, kind):
    # eager: blocks of 4 (10 full blocks and one token); compiled: the shared engine's blocks of 16
    engine = request.getfixturevalue("engine") if kind == "eager" else request.getfixturevalue("compiled_engines")("llama")
    prompt = _prompt(1, 41)
    hit = 40 // engine.kv_cache.block_size * engine.kv_cache.block_size
    names = [None, "qv8", "all4"]
    refs = {n: reference_greedy(models["llama"], prompt, NEW, adapters["llama"][n] if n else None)[0] for n in names}
    assert len({tuple(r) for r in refs.values()}) == 3, "the adapters must change the tokens for this to prove anything"
    hits_before = engine.kv_cache.prefix_cache_hits
    for round_ in range(2):
        for name in names:
            seq = Sequence(round_ * 10 + len(name or ""), prompt, GREEDY, name)
            assert engine.try_admit(seq)
            # first round: nothing cached under this adapter's root (not even what the others computed)
            assert seq.num_cached_tokens == (0 if round_ == 0 else hit), (round_, name)
            running = [seq]
            while running:
                engine.step(running)
                engine.release_finished(running)
            assert seq.output_ids == refs[name], (round_, name)
    assert engine.kv_cache.prefix_cache_hits - hits_before == 3 * hit
    _idle(engine)


def test_other_weights_under_a_used_name_never_hit_the_old_blocks(engine, models, tmp_path):
    prompt = _prompt(2, 33)
    first = make_peft_adapter(models["llama"], tmp_path / "v1", **ADAPTER_SPECS["qv8"])
    second = make_peft_adapter(models["llama"], tmp_path / "v2", **(ADAPTER_SPECS["qv8"] | {"seed": 99}))
    engine.adapters.register("tenant", str(first))
    assert engine.generate([prompt], GREEDY, adapters=["tenant"])[0] == reference_greedy(
        models["llama"], prompt, NEW, first)[0]
    engine.adapters.unregister("tenant")
    engine.adapters.register("tenant", str(second))
    seq = Sequence(50, prompt, GREEDY, "tenant")
    assert engine.try_admit(seq) and seq.num_cached_tokens == 0, "stale KV of the old weights was reused"
    running = [seq]
    while running:
        engine.step(running)
        engine.release_finished(running)
    assert seq.output_ids == reference_greedy(models["llama"], prompt, NEW, second)[0]
    # the same weights loaded again under the name do hit (the key is the weights, not the load)
    engine.adapters.unregister("tenant")
    shutil.copytree(second, tmp_path / "v2-copy")
    engine.adapters.register("tenant", str(tmp_path / "v2-copy"))
    again = Sequence(51, prompt, GREEDY, "tenant")
    assert engine.try_admit(again) and again.num_cached_tokens == 32
    engine.release(again)
    engine.adapters.unregister("tenant")
    _idle(engine)


@pytest.mark.parametrize("growth", ["lazy", "reserve"])
def test_a_budget_smaller_than_the_load_preempts_or_queues_and_every_output_stays_exact(models, adapters, growth):
    # 6 sequences of 30-45 tokens + 12 new in blocks of 4: ~80 blocks if all ran at once; the pool holds 40.
    small = build_engine(models["llama"], adapters["llama"], compile=False, block_size=4, max_seq_len=64,
                         kv_cache_memory=41 * _block_bytes(models), kv_growth=growth)
    assert small.kv_cache.num_blocks == 40
    prompts = [_prompt(10 + i, 30 + 3 * i) for i in range(6)]
    names = [None, "qv8", "all4", "mlp16rs", None, "qv8"]
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    alone = [small.generate([p], sp, adapters=[n])[0] for p, n in zip(prompts, names)]
    preemptions = small.num_preemptions
    assert small.generate(prompts, sp, adapters=names) == alone
    if growth == "lazy":
        assert small.num_preemptions > preemptions, "the load was meant to force preemption"
    else:
        assert small.num_preemptions == preemptions == 0
    _idle(small)


def _block_bytes(models) -> int:
    from lora_compile.config import ModelConfig
    from lora_compile.kv_cache.sizing import bytes_per_block
    import torch

    return bytes_per_block(ModelConfig.from_dir(models["llama"]), 4, torch.float32)


@pytest.mark.parametrize("seed", range(3))
def test_block_table_fuzz_matches_one_block_per_sequence(models, adapters, seed):
    """Random block sizes and prompts across block edges, sharing prefixes, joining mid-flight."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 3, 5, 7, 16])
    paged = build_engine(models["llama"], adapters["llama"], compile=False, block_size=block_size, max_seq_len=64)
    whole = build_engine(models["llama"], adapters["llama"], compile=False, block_size=64, max_seq_len=64,
                         enable_prefix_caching=False)
    stem = _prompt(100 + seed, 30)
    prompts, names = [], []
    for i in range(8):
        cut = rng.randrange(1, 30)
        prompts.append(stem[:cut] + _prompt(200 + 10 * seed + i, rng.randrange(1, 12)))
        names.append(rng.choice([None, "qv8", "all4"]))
    sp = SamplingParams(max_new_tokens=rng.randrange(3, 10), ignore_eos=True)
    expected = whole.generate(prompts, sp, adapters=names)
    assert paged.generate(prompts, sp, adapters=names) == expected
    assert paged.generate(prompts[::-1], sp, adapters=names[::-1]) == expected[::-1]  # now with hits
    assert paged.kv_cache.prefix_cache_hits > 0
    _idle(paged)


# --- through the real server --------------------------------------------------------------------------------

def test_through_the_server_base_and_adapters_then_again_hit_and_equal_peft():
    """gRPC and HTTP, the demo model: one long prompt to the base model and two adapters, then again; the second
    round is served from the prefix cache (usage says so) and every answer equals transformers + PEFT."""
    from tests.http_wire import post
    from tests.service_harness import ServerThread, demo_paths, shared_engine
    from service.server import ServerConfig

    model_dir, adapter_dirs = demo_paths()
    server = ServerThread(shared_engine(), ServerConfig(port=0, http_port=0, grace_period_s=10.0))
    try:
        prompt = _prompt(7, 150)
        names = [None, "pirate", "poet"]
        refs = {n: reference_greedy(model_dir, prompt, NEW, adapter_dirs[n] if n else None)[0] for n in names}
        assert len({tuple(r) for r in refs.values()}) == 3
        hit = (len(prompt) - 1) // server.engine.kv_cache.block_size * server.engine.kv_cache.block_size
        for round_ in range(2):
            with server.client() as client:
                for name in names:
                    out = client.complete(prompt, adapter=name or "", max_new_tokens=NEW, ignore_eos=True)
                    assert list(out.token_ids) == refs[name], (round_, name)
                    assert out.usage.cached_tokens == (hit if round_ else 0), (round_, name)
            for name in names:  # the HTTP door, the same cache
                body = {"model": name or server.engine.model_name, "prompt": prompt, "max_tokens": NEW,
                        "temperature": 0, "ignore_eos": True}
                status, reply, _ = post(server.server.http_port, "/v1/completions", body)
                assert status == 200, reply
                assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == hit
        server.wait_idle()
        assert server.engine.kv_cache.usage == 0.0
    finally:
        server.stop()
