"""The CUDA path: golden tokens against transformers + peft on the GPU, no recompile, no host synchronisation from
batch init through the forward, one host-to-device copy per step, non-blocking adapter loads, and decode steps
replayed from CUDA graphs. Every test that needs a GPU skips without one; the padded decode layout the graphs
replay is also checked on the CPU (same engine code, the graph not recorded)."""
from __future__ import annotations

import contextlib
import random

import pytest
import torch

from lora_compile import Engine, SamplingParams, Sequence
from lora_compile.core import engine as engine_module
from lora_compile.core.cuda_graphs import DecodeGraphs, batch_buckets, key_bucket
from tests.checkpoints import load_reference, make_peft_adapter, reference_greedy
from tests.conftest import ADAPTER_SPECS, build_engine
from tests.test_engine_compile import random_workload
from tests.test_engine_golden import NEW_TOKENS, PROMPTS, run_joining
from tests.test_lora import MIXED

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
JOIN_AT = [0, 0, 1, 2]
AGREE_FIRST = 8       # bf16: the first tokens of every sequence equal transformers' in bf16
AGREE_SHARE = 0.95    # bf16: top-1 agreement with transformers over all generated positions (teacher-forced)


def cuda_engine(model_dir, adapter_dirs, **overrides) -> Engine:
    return build_engine(model_dir, adapter_dirs, compile=True, device="cuda", **overrides)


@pytest.fixture(scope="module")
def cuda_engines(models, adapters):
    cache: dict[tuple, Engine] = {}

    def get(dtype: str = "float32", cuda_graphs: bool = True, lora_kernel: str = "auto",
            attention_backend: str = "auto") -> Engine:
        key = (dtype, cuda_graphs, lora_kernel, attention_backend)
        if key not in cache:
            cache[key] = cuda_engine(models["llama"], adapters["llama"], dtype=dtype, cuda_graphs=cuda_graphs,
                                     lora_kernel=lora_kernel, attention_backend=attention_backend)
        return cache[key]

    return get


def test_graph_buckets():
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert [key_bucket(n, 4096) for n in (1, 64, 65, 200, 256, 257, 700)] == [64, 64, 128, 256, 256, 512, 768]
    assert key_bucket(300, 192) == 192  # never past max_seq_len


@pytest.mark.slow
def test_padded_decode_steps_give_the_same_tokens(compiled_engines):
    """What a decode graph replays, run on the CPU: decode steps padded to a batch bucket and a key bucket (padding
    rows in the null KV block, never sampled) give exactly the unpadded steps' tokens and logits, and every padded
    step of one shape reads its inputs from the same addresses (DecodeGraphs raises otherwise)."""
    engine = compiled_engines("llama")
    plain_tokens, plain_logits = run_joining(engine, PROMPTS, adapters=MIXED, join_at=JOIN_AT)
    graphs = DecodeGraphs(engine.config.max_batch_size, engine.config.max_seq_len, engine.device, capture=False)
    engine._graphs = graphs
    try:
        tokens, logits = run_joining(engine, PROMPTS, adapters=MIXED, join_at=JOIN_AT)
    finally:
        engine._graphs = None
    assert tokens == plain_tokens
    for ours, plain in zip(logits, plain_logits):
        torch.testing.assert_close(ours, plain, atol=1e-3, rtol=1e-3)
    assert graphs.replays > NEW_TOKENS // 2 and 2 <= graphs.num_graphs <= 2 * 4 * 3  # variants x rows x keys


@needs_cuda
@pytest.mark.parametrize("cuda_graphs,lora_kernel,attention", [
    (True, "auto", "auto"), (False, "auto", "auto"), (True, "indexed", "auto"), (True, "auto", "inductor"),
    (True, "gathered", "auto"), (True, "stacked", "auto")],
    ids=["graphs", "no-graphs", "indexed-graphs", "inductor-attention-graphs", "gathered-graphs", "stacked-graphs"])
def test_cuda_float32_mixed_batch_matches_peft(cuda_engines, models, adapters, cuda_graphs, lora_kernel, attention):
    """Compiled, float32, a batch mixing the base model and three adapters, sequences joining at different steps:
    exactly transformers + peft's greedy tokens on the GPU, close logits."""
    engine = cuda_engines("float32", cuda_graphs, lora_kernel, attention)
    replays = engine._graphs.replays if cuda_graphs else 0
    tokens, logits = run_joining(engine, PROMPTS, adapters=MIXED, join_at=JOIN_AT)
    for i, (prompt, name) in enumerate(zip(PROMPTS, MIXED)):
        adapter_dir = adapters["llama"][name] if name else None
        ref_tokens, ref_logits = reference_greedy(models["llama"], prompt, NEW_TOKENS, adapter_dir, device="cuda")
        assert len(set(ref_tokens)) > 4, "degenerate reference: the test would prove nothing"
        assert tokens[i] == ref_tokens, f"sequence {i} (adapter {name}) differs from the reference"
        torch.testing.assert_close(logits[i].cpu(), ref_logits, atol=2e-3, rtol=1e-3)
    if cuda_graphs:
        assert engine._graphs.replays - replays > NEW_TOKENS // 2, "decode steps did not replay graphs"
    else:
        assert engine._graphs is None


def _teacher_forced_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The reference's logits at each of `tokens` (generated after `prompt`), given our prefix: (len(tokens), vocab)
    float32 on the CPU."""
    ids = torch.tensor([prompt + tokens], device="cuda")
    with torch.no_grad():
        return model(input_ids=ids).logits[0, len(prompt) - 1:-1].float().cpu()


def _agrees(ours: int, ref16: torch.Tensor, ref32: torch.Tensor) -> bool:
    """Whether our token at one position agrees with the bf16 reference's, given that reference's and the float32
    reference's logits there: it is the bf16 reference's top-1, or the float32 reference's, or the float32 margin
    between the two tokens is within the bf16 reference's own error on them (a near-tie that bf16 rounding in
    either order may take either way)."""
    top = int(ref16.argmax())
    if ours in (top, int(ref32.argmax())):
        return True
    margin32 = float(ref32[top] - ref32[ours])
    own_error = float((ref16[top] - ref32[top]).abs() + (ref16[ours] - ref32[ours]).abs())
    return margin32 <= own_error


@needs_cuda
def test_cuda_kernel_policy(cuda_engines):
    """On CUDA every dtype takes the masked LoRA kernel (compile_policy.lora_kernel: measured fastest on an H100,
    docs/benchmarks.md); the grouped one runs when asked for."""
    assert cuda_engines("bfloat16").lora_kernel == "masked"
    assert cuda_engines("bfloat16").attention_backend == "sdpa"  # compile_policy.attention_backend
    assert cuda_engines("float32").lora_kernel == "masked"
    assert cuda_engines("bfloat16", lora_kernel="grouped").lora_kernel == "grouped"


@needs_cuda
@pytest.mark.parametrize("lora_kernel", ["auto", "grouped", "stacked"])
def test_cuda_bf16_agrees_with_transformers_bf16(cuda_engines, models, adapters, lora_kernel):
    """bfloat16 (weights, LoRA slots, KV cache), a mixed batch, against transformers + peft given the same prefixes:
    each sequence's first AGREE_FIRST tokens agree with the bf16 reference, and so do at least AGREE_SHARE of all
    positions. In bf16 the two round in different orders (fused QKV, LoRA scaling folded into B, float32
    accumulation inside fused kernels), so where our token is not the bf16 reference's top-1 the float32 reference
    decides (_agrees): a parting inside the bf16 reference's own error is a tie. Every parting is printed with our
    logits beside both references'."""
    engine = cuda_engines("bfloat16", lora_kernel=lora_kernel)
    print(f"LoRA kernel {engine.lora_kernel}")
    assert engine.model.layers[0].self_attn.k_cache.dtype == torch.bfloat16
    _assert_bf16_agreement(engine, models["llama"], adapters)


def _assert_bf16_agreement(engine: Engine, reference_dir, adapters) -> None:
    """The bf16 agreement rule above, for `engine` against transformers + peft loading `reference_dir` (the test
    model, or its dequantised weights for a quantized engine)."""
    tokens, logits = run_joining(engine, PROMPTS, adapters=MIXED, join_at=JOIN_AT)
    agree, exact = [], 0
    for prompt, name, ours, our_logits in zip(PROMPTS, MIXED, tokens, logits):
        adapter_dir = adapters["llama"][name] if name else None
        ref16 = _teacher_forced_logits(load_reference(reference_dir, adapter_dir, torch.bfloat16, "cuda"), prompt, ours)
        ref32 = _teacher_forced_logits(load_reference(reference_dir, adapter_dir, torch.float32, "cuda"), prompt, ours)
        assert len(set(ref32.argmax(-1).tolist())) >= AGREE_FIRST // 2, "degenerate reference: the test proves nothing"
        ok = [_agrees(t, r16, r32) for t, r16, r32 in zip(ours, ref16, ref32)]
        exact += sum(t == int(r.argmax()) for t, r in zip(ours, ref16))
        for i, (t, r16, r32) in enumerate(zip(ours, ref16, ref32)):
            top = int(r16.argmax())
            if t != top:
                print(f"adapter {name} position {i}: ours {t} (ours {our_logits[i][t]:.4f}, bf16 ref {r16[t]:.4f}, "
                      f"f32 ref {r32[t]:.4f}) vs bf16 ref's {top} (ours {our_logits[i][top]:.4f}, bf16 ref "
                      f"{r16[top]:.4f}, f32 ref {r32[top]:.4f}): {'tie' if ok[i] else 'DIFFERS'}")
        assert all(ok[:AGREE_FIRST]), f"adapter {name}: first tokens differ beyond a bf16 near-tie"
        agree += ok
    print(f"bf16 reference's top-1 at {exact}/{len(agree)} positions; agreeing (ties included) {sum(agree)}")
    assert sum(agree) / len(agree) >= AGREE_SHARE


@needs_cuda
@pytest.mark.slow
def test_cuda_random_workload_never_recompiles_or_recaptures_for_a_new_mix(models, adapters, tmp_path):
    """Any batch size, prefill/decode mix and adapter mix, with adapters evicted and reloaded into slots: no
    recompile (steps run under fail_on_recompile); decode graphs are captured per shape only, so a second pass
    over other adapters in the same shapes captures nothing new."""
    extra = make_peft_adapter(models["llama"], tmp_path / "extra", r=8, lora_alpha=16, seed=21,
                              target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    engine = cuda_engine(models["llama"], adapters["llama"] | {"extra": extra}, dtype="bfloat16")
    seen = random_workload(engine, random.Random(0), 200, [None, *ADAPTER_SPECS, "extra"], max_prompt=60, max_new=40)
    assert len(seen) >= 4, f"the workload ran few batch sizes: {seen}"
    for n in sorted(set(range(1, engine.config.max_batch_size + 1)) - seen):  # every size, graphs too
        engine.generate([[5, 6, 7]] * n, SamplingParams(max_new_tokens=8, ignore_eos=True),
                        adapters=[("qv8" if i % 2 else None) for i in range(n)])
    assert engine._graphs.replays > 50 and engine._graphs.num_graphs <= 2 * len(engine._graphs.batch_sizes) * 3
    names = [*ADAPTER_SPECS, "extra"]  # four adapters, three slots: each mix below loads one into a slot

    def run_mix(mix: list[str | None]) -> None:
        run = [Sequence(i, [7, 8, 9, 10], SamplingParams(max_new_tokens=20, ignore_eos=True), n)
               for i, n in enumerate(mix)]
        assert all(engine.try_admit(s) for s in run)
        while run:
            engine.step(run)
            engine.release_finished(run)

    run_mix(names[:3])  # captures these shapes, if the random workload did not
    before = engine._graphs.num_graphs
    engine.adapters.take_events()
    for mix in (names[1:], [names[3], names[0], None], [names[2], names[3], names[0]]):
        run_mix(mix)
    assert engine._graphs.num_graphs == before, "a new adapter mix or newly loaded adapter re-captured a graph"
    assert sum(e.kind == "device_copy" for e in engine.adapters.take_events()) >= 2  # adapters were loaded
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def _mixed_workload(engine: Engine) -> None:
    """Decode, prefill and mixed steps, base model and adapters, at several batch sizes."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(5)]
    names = [None, "qv8", "all4", None, "mlp16rs"]
    engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True), adapters=names)
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=6, ignore_eos=True), adapters=[None, None])


@needs_cuda
@pytest.mark.parametrize("lora_kernel", ["auto", "grouped", "stacked"])
def test_cuda_no_host_sync_from_batch_init_through_forward(cuda_engines, monkeypatch, lora_kernel):
    """Under torch.cuda.set_sync_debug_mode("error") every synchronising CUDA call raises. Admission (adapter slot
    loads included), batch init (built ahead too) and the forward run in that mode; only sampling's one read of the
    tokens, at the end of the step, runs outside it."""
    engine = cuda_engines("bfloat16", lora_kernel=lora_kernel)
    _mixed_workload(engine)  # captures this workload's graphs (a capture synchronises, once per shape)
    captured, hits = engine._graphs.num_graphs, engine.ahead.hits
    with _sync_errors_but_in_sampling(monkeypatch) as reads:
        _mixed_workload(engine)
    assert reads and engine._graphs.num_graphs == captured
    assert engine.ahead.hits > hits + 10  # decode steps took their batch init built ahead


@contextlib.contextmanager
def _sync_errors_but_in_sampling(monkeypatch):
    """torch.cuda.set_sync_debug_mode("error") inside: every synchronising CUDA call raises, except in sampling,
    whose one read of the tokens ends a step. Yields the rows of each sample() call."""
    real_sample, reads = engine_module.sample, []

    def sample_outside_error_mode(logits, seqs, *rest):
        torch.cuda.set_sync_debug_mode("default")
        try:
            reads.append(len(seqs))
            return real_sample(logits, seqs, *rest)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(engine_module, "sample", sample_outside_error_mode)
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield reads
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _htod_copies(prof) -> list[str]:
    return [e.name for e in prof.events() if "Memcpy HtoD" in e.name]


@needs_cuda
@pytest.mark.parametrize("dtype,cuda_graphs", [("float32", True), ("bfloat16", True), ("bfloat16", False)],
                         ids=["f32-graphs", "bf16-graphs", "bf16-no-graphs"])
def test_cuda_one_host_to_device_copy_per_step(cuda_engines, dtype, cuda_graphs):
    """Every step (decode, prefill, mixed; base model, one adapter, several) runs on metadata copied to the device
    once, counted from the GPU's own memcpy records (torch.profiler); adapters are resident, so nothing else
    copies. A decode step built ahead (step_ahead) is copied during the step before it, which then also copies
    its own if it was built in turn: each call copies (built in turn) + (built ahead), never more."""
    from torch.profiler import ProfilerActivity, profile

    engine = cuda_engines(dtype, cuda_graphs)
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    mixes = [[None], ["qv8"], [None, "qv8", "all4", "mlp16rs", None, "qv8"], ["all4", "all4", None]]
    counts, expected, kinds = [], [], set()
    for names in mixes:
        engine.generate([PROMPTS[0]] * len(names), sp, adapters=names)  # warm: graphs, adapters resident
        seqs = [Sequence(i, PROMPTS[i % 3], sp, n) for i, n in enumerate(names)]
        for s in seqs:
            assert engine.try_admit(s)
        running = list(seqs)
        while running:
            hits, built = engine.ahead.hits, engine.ahead.built
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                out = engine.step(running)
                torch.cuda.synchronize()
            counts.append(len(_htod_copies(prof)))
            expected.append(int(engine.ahead.hits == hits) + engine.ahead.built - built)
            kinds.add((out.kind, out.num_adapters > 0, out.cuda_graph))
            engine.release_finished(running)
    assert counts == expected, (counts, expected)
    assert engine.ahead.hits > 0 and max(counts) <= 2
    assert {k for k, _, _ in kinds} >= {"prefill", "decode"} and {a for _, a, _ in kinds} == {True, False}
    assert any(g for _, _, g in kinds) == cuda_graphs


@needs_cuda
def test_cuda_adapter_loads_copy_from_pinned_memory_without_blocking(cuda_engines, models, adapters):
    """An adapter read for the GPU sits in pinned host memory, and loading it into a slot while steps are queued
    synchronises nothing (its copy runs on a side stream the next step waits for); its tokens then match peft."""
    engine = cuda_engines("float32")
    adapter = engine.adapters.read("pinned-check", str(adapters["llama"]["all4"]))
    assert all(a.is_pinned() and b.is_pinned() for layer in adapter.weights for a, b in layer.values())
    engine.adapters.register_loaded(adapter)
    running = [Sequence(0, PROMPTS[0], SamplingParams(max_new_tokens=24, ignore_eos=True))]
    assert engine.try_admit(running[0])
    engine.step(running)  # prefill; the next steps decode while the adapter loads
    late = Sequence(1, PROMPTS[1], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True), "pinned-check")
    torch.cuda.set_sync_debug_mode("error")
    try:
        assert engine.try_admit(late) and late.adapter_loaded  # copied into a slot now
    finally:
        torch.cuda.set_sync_debug_mode("default")
    running.append(late)
    while running:
        engine.step(running)
        engine.release_finished(running)
    ref, _ = reference_greedy(models["llama"], PROMPTS[1], NEW_TOKENS, adapters["llama"]["all4"], device="cuda")
    assert late.output_ids == ref


@pytest.mark.parametrize("names", [[None, None], ["qv8", None, "all4"], ["qv8"]], ids=["base", "mixed", "one"])
def test_decode_path_lays_out_what_the_general_path_does(models, adapters, names):
    """Decode-only steps fill the metadata buffer with whole-column writes (batch_init._build_decode); every input
    holds what the general, list-built layout gives for the same step."""
    engine = build_engine(models["llama"], adapters["llama"], compile=False)
    seqs = [Sequence(i, PROMPTS[i][:5] + [i + 1], SamplingParams(max_new_tokens=8, ignore_eos=True), n)
            for i, n in enumerate(names)]
    for s in seqs:
        assert engine.try_admit(s)
    try:
        while any(s.num_computed_tokens < s.num_tokens - 1 for s in seqs):
            engine.step(seqs)  # prefill (and maybe a decode): every sequence has one token left
        single, chunks = engine.batch_init.plan(seqs)
        assert not chunks
        general = engine.batch_init._build_general(single, [], merged=False)
        expected = [None if t is None else t.clone() for t in (general.input_ids, general.positions,
                    *vars(general.attn).values(), general.lora.weight_indices, general.logits_idx)]
        decode, _ = engine.batch_init._build_decode(single, merged=False, graph=None)
        got = (decode.input_ids, decode.positions, *vars(decode.attn).values(), decode.lora.weight_indices,
               decode.logits_idx)
        for e, g in zip(expected, got, strict=True):
            assert (e is None) == (g is None)
            if e is not None:
                assert torch.equal(e, g)
        assert decode.sampled == general.sampled and decode.num_adapters == general.num_adapters
    finally:
        for s in seqs:
            engine.release(s)


@needs_cuda
def test_cuda_structured_outputs_parse_without_a_host_sync(cuda_engines, monkeypatch):
    """Constrained rows beside free ones on CUDA (bf16, graphs, builds made ahead): 60 sampled answers all parse
    and validate, and the bitmask's fill and copy add no host synchronisation (only sampling's one read, outside
    the check, as in test_cuda_no_host_sync_from_batch_init_through_forward)."""
    from tests.test_structured_output import _check, sampled_workload

    engine = cuda_engines("bfloat16")
    kinds, prompts, params, names = sampled_workload(60)
    first = engine.generate_sequences(prompts, params, names)  # captures its graphs (a capture synchronises)
    with _sync_errors_but_in_sampling(monkeypatch):
        seqs = engine.generate_sequences(prompts, params, names)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in first]  # seeded: the same answers again
    assert {s.finish_reason for s in seqs} <= {"eos", "grammar"}
    for kind, seq in zip(kinds, seqs):
        _check(kind, engine.tokenizer.decode(seq.output_ids))
