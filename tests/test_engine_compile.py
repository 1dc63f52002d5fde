"""Compilation: after warm-up no workload recompiles (steps run under fail_on_recompile), chunked prefill
lets decoding sequences keep going, and the Inductor cache directory is used, the saved layer stack with it."""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from lora_compile import Engine, EngineConfig, SamplingParams, Sequence
from lora_compile.core.precompile import PrecompiledStack, RecompileError, artifact_key
from tests.conftest import ADAPTER_SPECS, ENGINE_LIMITS, INDUCTOR_CACHE, build_engine

pytestmark = pytest.mark.slow


# Sampling options taken in turn by arrival (not drawn: the workload's random stream stays as it was): prompt
# log-probabilities add logits rows, the others sampler work; neither may change the compiled graph.
OPTIONS = ({}, dict(prompt_logprobs=2), dict(temperature=0.8, seed=1, min_p=0.1, top_k=20),
           dict(logit_bias=((5, 2.0),), presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2))


def random_workload(engine: Engine, rng: random.Random, steps: int, names: list[str | None], max_prompt: int = 100,
                    max_new: int = 12) -> set[int]:
    """`steps` steps of random arrivals, prompt lengths, budgets and adapters (any recompile raises inside step(): the
    engine is past warm-up); returns the batch sizes stepped. Releases everything it admitted."""
    running: list[Sequence] = []
    next_id, done, sizes_seen = 1000, 0, set()
    while done < steps:
        while len(running) < engine.config.max_batch_size and rng.random() < 0.5:
            prompt = [rng.randrange(1, 300) for _ in range(rng.choice([1, 2, 3, rng.randrange(4, max_prompt)]))]
            seq = Sequence(next_id, prompt, SamplingParams(max_new_tokens=rng.randrange(1, max_new), ignore_eos=True,
                                                        **OPTIONS[next_id % len(OPTIONS)]), rng.choice(names))
            next_id += 1
            if not engine.try_admit(seq):
                break
            running.append(seq)
        if not running:
            continue
        engine.step(running)
        sizes_seen.add(len(running))
        done += 1
        engine.release_finished(running)
    for seq in running:
        engine.release(seq)
    return sizes_seen


def test_random_workload_never_recompiles(compiled_engines):
    """Batch sizes 1..max, prompt lengths 1..100, prefill/decode mixes, any adapter mix and every sampling option
    (OPTIONS), with adapters evicted and reloaded (4 adapters, 3 slots): any recompile raises inside step()."""
    engine = compiled_engines("llama")
    names = [None, *ADAPTER_SPECS]
    max_batch = engine.config.max_batch_size
    torch._dynamo.utils.counters.clear()
    # Start with every slot in use at once (max_loras_per_batch adapters in one step), then random traffic.
    full = [Sequence(900 + i, [5, 6, 7], SamplingParams(max_new_tokens=2, ignore_eos=True), n)
            for i, n in enumerate(names[1:engine.config.max_loras_per_batch + 1])]
    engine.generate([s.prompt_ids for s in full], full[0].sampling, adapters=[s.adapter for s in full])
    sizes_seen = random_workload(engine, random.Random(0), 120, names)
    assert sizes_seen >= set(range(1, max_batch + 1)), f"workload did not cover every batch size: {sizes_seen}"
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks and engine.num_running == 0
    assert engine.adapters.num_free_slots == engine.config.max_loras_per_batch


@pytest.mark.parametrize("bad", ["dtype", "tokens"])
def test_recompile_would_be_caught(compiled_engines, bad):
    """The guard is real: inputs the compiled stack was not traced for (hidden states of another dtype, or one row
    more than the step's metadata describes) fail instead of recompiling."""
    engine = compiled_engines("llama")
    seq = Sequence(1, [1, 2, 3], SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert engine.try_admit(seq)
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            single, chunks = engine.batch_init.plan([seq])
            fb = engine._forward_batch(engine.batch_init.build(single, chunks))
            rows, hidden = fb.cos.shape[0], engine.model_config.hidden_size
            h = (torch.zeros(rows, hidden, dtype=torch.float64) if bad == "dtype"
                 else torch.zeros(rows + 1, hidden, dtype=engine.dtype))
            with pytest.raises(Exception, match="(?i)recompil"):
                engine.model._run_layers(h, fb)  # the compiled layer stack
    finally:
        engine.release(seq)


def test_a_lone_prompt_chunk_attends_as_two_halves(compiled_engines):
    """The prefill group has at least two rows, each as wide as the longest: a lone chunk is laid out as its two
    halves (batch_init.attention_rows), not as itself beside a padding row that costs as much attention. The
    golden tests check the tokens of every lone prompt, which all take this layout."""
    engine = compiled_engines("llama")
    seq = Sequence(1, list(range(3, 12)), SamplingParams(max_new_tokens=2, ignore_eos=True))  # 9 tokens
    assert engine.try_admit(seq)
    try:
        md = engine.batch_init.build(*engine.batch_init.plan([seq])).attn
        assert md.prefill_q_pos.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 0]]
        # the step's tokens in order, then the dummy token (index 9) that pads the second half
        assert md.prefill_token_idx.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
        assert md.prefill_block_table[0].tolist() == md.prefill_block_table[1].tolist()  # one sequence's table
    finally:
        engine.release(seq)


def test_a_chunk_the_budget_would_cut_short_waits_rather_than_pad_the_step(compiled_engines):
    """Every attention row is as wide as the step's widest chunk: a prompt the budget would cut to under half of
    that waits for the next step (its row would cost as much attention as the widest, and it would not finish
    anyway); one cut to half or more, and one that completes, go in."""
    engine = compiled_engines("llama")
    budget = engine.config.max_num_batched_tokens
    greedy = SamplingParams(max_new_tokens=2, ignore_eos=True)
    tail = Sequence(1, list(range(3, 3 + budget + 20)), greedy)       # its first step, then 20 tokens
    short_tail = Sequence(2, list(range(3, 3 + budget + 10)), greedy)  # its first step, then 10
    long_prompt = Sequence(3, list(range(5, 45)), greedy)              # 40 tokens: more than any step holds
    whole = Sequence(4, [5, 6, 7], greedy)                              # done in one chunk
    seqs = [tail, short_tail, long_prompt, whole]
    assert all(engine.try_admit(s) for s in seqs)
    try:
        engine.step([tail])
        engine.step([short_tail])
        _, chunks = engine.batch_init.plan([tail, long_prompt, whole])
        # 20 + 4 of the 40 would pad the 4 to 20: it waits; the 3-token prompt completes in the room left
        assert [(p.seq.seq_id, p.length) for p in chunks] == [(1, 20), (4, 3)]
        _, chunks = engine.batch_init.plan([short_tail, long_prompt])
        assert [(p.seq.seq_id, p.length) for p in chunks] == [(2, 10), (3, budget - 10)]
    finally:
        for s in seqs:
            engine.release(s)


def test_a_second_start_loads_the_saved_stack(compiled_engines, models, adapters):
    """A second engine with the same model and limits loads both graph variants from the cache directory (no
    tracing) and generates the same tokens as the first, and as one whose stack torch.compile traces at start."""
    first = compiled_engines("llama")
    second = build_engine(models["llama"], adapters["llama"], compile=True)
    assert second.model._run_layers.sources == {"base": "loaded", "lora": "loaded"}
    seq = Sequence(1, [1, 2, 3], SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert second.try_admit(seq)
    try:  # the loaded stack keeps its shape guards: a step with one row more than its metadata fails
        fb = second._forward_batch(second.batch_init.build(*second.batch_init.plan([seq])))
        with pytest.raises(RecompileError, match="would recompile"):
            h = torch.zeros(fb.cos.shape[0] + 1, second.model_config.hidden_size, dtype=second.dtype)
            second.model._run_layers(h, fb)
    finally:
        second.release(seq)
    traced = build_engine(models["llama"], adapters["llama"], compile=True, precompile=False)
    assert not isinstance(traced.model._run_layers, PrecompiledStack)
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5, 4], [11], [3, 1, 4, 1, 5]]
    names = [None, "qv8", "all4", "mlp16rs"]
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    expected = first.generate(prompts, sp, adapters=names)
    assert len({tuple(t) for t in expected}) == len(prompts)  # the prompts and adapters lead to different tokens
    assert second.generate(prompts, sp, adapters=names) == expected
    assert traced.generate(prompts, sp, adapters=names) == expected


def test_an_unreadable_saved_stack_is_compiled_again(models, tmp_path):
    """A saved stack that does not load (an interrupted write, another build) is compiled and saved anew."""
    def engine_on(directory):
        engine = Engine(EngineConfig(model=str(models["llama"]), inductor_cache_dir=INDUCTOR_CACHE, **ENGINE_LIMITS))
        engine.model._run_layers.directory = directory
        return engine

    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    first = engine_on(tmp_path)
    first.model._run_layers.path("base").write_bytes(b"half a file")
    tokens = first.generate([[5, 6, 7]], sp)  # base-model steps only: one variant
    assert first.model._run_layers.sources == {"base": "compiled"}
    again = engine_on(tmp_path)
    assert again.generate([[5, 6, 7]], sp) == tokens
    assert again.model._run_layers.sources == {"base": "loaded"}


def test_a_stack_that_cannot_be_saved_still_serves(models, tmp_path, caplog):
    """An unwritable cache directory costs the next start its compile, not this one its service."""
    (tmp_path / "a-file").write_text("")
    engine = Engine(EngineConfig(model=str(models["llama"]), inductor_cache_dir=INDUCTOR_CACHE, **ENGINE_LIMITS))
    engine.model._run_layers.directory = tmp_path / "a-file" / "stacks"
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    with caplog.at_level("WARNING", logger="lora_compile.core.precompile"):
        tokens = engine.generate([[5, 6, 7]], sp)  # the base variant only
    assert engine.model._run_layers.sources == {"base": "compiled"}
    assert "could not save the compiled layer stack" in caplog.text
    reference = Engine(EngineConfig(model=str(models["llama"]), compile=False, **ENGINE_LIMITS))
    assert tokens == reference.generate([[5, 6, 7]], sp)


def test_long_prompt_is_chunked_while_others_decode(compiled_engines):
    engine = compiled_engines("llama")
    budget = engine.config.max_num_batched_tokens
    decoders = [Sequence(i, [3 + i, 4, 5], SamplingParams(max_new_tokens=40, ignore_eos=True)) for i in range(2)]
    running = list(decoders)
    for seq in running:
        assert engine.try_admit(seq)
    engine.step(running)  # prefill the short prompts
    long_prompt = Sequence(9, [(7 * i) % 290 + 1 for i in range(5 * budget)], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert engine.try_admit(long_prompt)
    running.append(long_prompt)
    prefill_steps = 0
    while not long_prompt.output_ids:
        out = engine.step(running)
        prefill_steps += 1
        # every step, both decoding sequences get their token; the step stays within the token budget
        assert {0, 1} <= set(out.seq_ids)
        assert out.num_tokens <= budget
    assert prefill_steps >= 5  # the prompt went in chunks, not in one stall
    for seq in running:
        engine.release(seq)


def test_decode_steps_skip_the_placeholder_prefill_group(compiled_engines):
    """Compiled on CPU, a decode-only step runs no prefill attention (its group is a placeholder: no attention
    kernel), while steps with prefill chunks, mixed with decodes or not, run it in every layer (the golden tests
    check tokens). Prefill attends through torch's fused CPU attention (compile_policy.prefill_attention_backend)."""
    from torch.profiler import ProfilerActivity, profile

    engine = compiled_engines("llama")
    layers = engine.model.config.num_hidden_layers

    assert engine.prefill_backend == "sdpa"

    def attention_calls(running: list[Sequence]) -> int:  # (the fused attention kernel: once a layer)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.step(running)
        return sum(e.count for e in prof.key_averages() if e.key == "aten::_scaled_dot_product_flash_attention_for_cpu")

    running = [Sequence(i, [3 + i, 4, 5, 6, 7], SamplingParams(max_new_tokens=8, ignore_eos=True)) for i in range(2)]
    for seq in running:
        assert engine.try_admit(seq)
    try:
        assert attention_calls(running) == layers  # prefill only
        assert attention_calls(running) == 0  # decode only: skipped
        late = Sequence(5, [9, 8, 7], SamplingParams(max_new_tokens=4, ignore_eos=True))
        assert engine.try_admit(late)
        running.append(late)
        assert attention_calls(running) == layers  # decodes beside a prefill chunk
        assert attention_calls(running) == 0
    finally:
        for seq in running:
            engine.release(seq)


def test_inductor_cache_directory_is_used(compiled_engines):
    engine = compiled_engines("llama")
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == INDUCTOR_CACHE
    assert any(os.scandir(INDUCTOR_CACHE))
    # the directory configure chose is the one the saved stack goes to
    assert engine.inductor_cache_dir == Path(INDUCTOR_CACHE)
    assert engine.model._run_layers.directory == Path(INDUCTOR_CACHE) / "lora-serve-stacks"


@pytest.mark.parametrize("max_loras", [1])  # (2, like the suite engines' 3, adds a compile and nothing else)
def test_small_slot_counts_warm_up_and_never_recompile(models, adapters, max_loras):
    """With 1 or 2 slots, warm-up's two variants (base, adapters) serve every mix: no graph per slot count."""
    names = list(adapters["llama"])[:max_loras]
    engine = build_engine(models["llama"], {n: adapters["llama"][n] for n in names}, compile=True,
                          max_loras_per_batch=max_loras)
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True)
    for mix in ([None], names[:1], names, [None, *names]):
        engine.generate([[5, 6, 7]] * len(mix), sp, adapters=mix)  # raises on a recompile


def test_the_saved_stack_key_follows_what_shapes_the_graph(models, monkeypatch):
    """Equal settings share a saved stack; limits, packing and dtype that change the graph's tensors do not, nor
    does another vector ISA for the generated code (another CPU sharing the directory)."""
    def key(**changes):
        config = EngineConfig(model=str(models["llama"]), compile=False, **(ENGINE_LIMITS | changes))
        return artifact_key(Engine(config).model)

    base = key()
    assert key() == base
    assert key(max_num_batched_tokens=48) == base  # a per-step budget: dynamic sizes, not the graph
    # The KV pool's shape is the graph's, not max_seq_len or max_num_seqs: 4 x 288 positions give the same
    # default pool as 6 x 192 (KV_MAX_SEQ_FILLS of each, in blocks of 16).
    assert key(max_num_seqs=4, max_seq_len=288) == base
    changed = [key(max_seq_len=128), key(block_size=8), key(max_lora_rank=8), key(max_loras_per_batch=2),
               key(prepack_weights=False), key(dtype="bfloat16")]
    assert len({base, *changed}) == len(changed) + 1
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")  # what Inductor writes its CPU kernels for: scalar code
    assert key() != base
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    assert key() == base
    # The engine's source, sub-packages included: an upgrade that changes how a layer computes never loads the
    # stack saved by the old code (a key over lora_compile/core alone did).
    read_bytes = Path.read_bytes
    for module in ("model/quantization/kernels.py", "model/layers.py", "core/engine.py"):
        monkeypatch.setattr(Path, "read_bytes", lambda path, m=module: read_bytes(path) + (
            b"#" if path.as_posix().endswith("lora_compile/" + m) else b""))
        assert key() != base, module


@pytest.mark.parametrize("attention", ["inductor", "sdpa"])
def test_each_layer_compiled_on_its_own_matches_peft_and_never_recompiles(models, adapters, monkeypatch, attention):
    """What torch < 2.12 runs (compiled_stack.compile_each_layer, CUDA's image today), here on the CPU: every decoder
    layer a call of one compiled frame, with either attention form; transformers + peft's greedy tokens for a mixed
    batch, and a random workload without a recompile after warm-up (a step that would recompile raises)."""
    from lora_compile import compile_policy
    from tests.checkpoints import reference_greedy
    from tests.test_engine_golden import NEW_TOKENS, PROMPTS, run_joining
    from tests.test_lora import MIXED

    monkeypatch.setattr(compile_policy, "REUSE_HASH", False)
    engine = build_engine(models["llama"], adapters["llama"], compile=True, attention_backend=attention)
    assert not isinstance(engine.model._run_layers, PrecompiledStack)
    tokens, logits = run_joining(engine, PROMPTS, adapters=MIXED, join_at=[0, 0, 1, 2])
    for i, (prompt, name) in enumerate(zip(PROMPTS, MIXED)):
        ref_tokens, ref_logits = reference_greedy(models["llama"], prompt, NEW_TOKENS,
                                                  adapters["llama"][name] if name else None)
        assert tokens[i] == ref_tokens, f"sequence {i} (adapter {name}) differs from the reference"
        torch.testing.assert_close(logits[i], ref_logits, atol=2e-3, rtol=1e-3)
    random_workload(engine, random.Random(1), 60, [None, *ADAPTER_SPECS])
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
