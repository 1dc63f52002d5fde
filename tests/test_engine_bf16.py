"""bfloat16 on CPU end to end (weights, LoRA slots, KV cache) against transformers + PEFT in bfloat16.

float32 is the reference for the exact golden tests (test_engine_golden.py). In bfloat16 (8 mantissa bits) our
kernels and transformers' round in a different order, so a long greedy run may part at a near-tie; the criterion is
agreement: the first AGREE greedy tokens equal transformers' in bfloat16, on a reference that is not degenerate
(at least AGREE // 2 distinct tokens), with base-model and adapter sequences in one batch.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lora_compile import Engine, EngineConfig, SamplingParams, Sequence
from lora_compile import compile_policy
from lora_compile import config as config_module
from lora_compile.config import resolve_dtype
from lora_compile.model.packed_gemm import native_bf16
from tests.checkpoints import reference_greedy
from tests.conftest import ENGINE_LIMITS

AGREE = 8
PROMPT = [3, 17, 29, 5, 44, 90, 12]


@pytest.mark.parametrize("adapter", [None, "all4"])
def test_bf16_greedy_agrees_with_transformers_bf16(models, adapters, adapter):
    engine = Engine(EngineConfig(model=str(models["llama"]), compile=False, **(ENGINE_LIMITS | {"dtype": "bfloat16"})))
    assert engine.dtype == torch.bfloat16
    for name, path in adapters["llama"].items():
        engine.adapters.register(name, str(path))
    other = "qv8" if adapter is None else None  # a neighbour on the other path, in the same steps
    ours = engine.generate([PROMPT, PROMPT], SamplingParams(max_new_tokens=AGREE, ignore_eos=True),
                           adapters=[adapter, other])
    attn = engine.model.layers[0].self_attn
    # KV cache and the LoRA slots (stacked A, B) hold bfloat16, the adapter's float32 files converted on load.
    stored = [attn.k_cache, attn.v_cache, attn.qkv_proj.lora_a_stack, attn.qkv_proj.lora_b]
    assert [t.dtype for t in stored] == [torch.bfloat16] * len(stored)
    ref, _ = reference_greedy(models["llama"], PROMPT, AGREE, adapters["llama"][adapter] if adapter else None,
                              torch.bfloat16)
    assert len(set(ref)) >= AGREE // 2, f"degenerate reference {ref}"
    assert ours[0] == ref


def test_auto_dtype_is_bf16_only_where_the_cpu_computes_it(monkeypatch):
    """`auto` picks bfloat16 on a CPU with native bf16 (half the bytes per decode step), float32 on one without
    (emulated bf16 is slower than float32), and always bfloat16 on CUDA."""
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if native_bf16() else torch.float32)
    monkeypatch.setattr(config_module, "native_bf16", lambda: False)
    assert resolve_dtype("auto", cpu) == torch.float32
    monkeypatch.setattr(config_module, "native_bf16", lambda: True)
    assert resolve_dtype("auto", cpu) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float32", cpu) == torch.float32


def test_native_bf16_follows_the_cpu_flags_not_onednn(monkeypatch):
    """bf16 counts as native only with the instructions (avx512_bf16 or AMX), as /proc/cpuinfo lists them: oneDNN's
    own check says yes on any AVX-512 CPU, where it would emulate bf16 slower than float32."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        flags = set(cpuinfo.read_text().split())
        assert native_bf16() == bool({"avx512_bf16", "amx_bf16"} & flags)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True, raising=False)
    assert not native_bf16()  # an AVX-512 CPU without bf16 instructions: oneDNN would say yes
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32


def _grouped_engine(models, adapters, compile: bool, **limits):
    engine = Engine(EngineConfig(model=str(models["llama"]), compile=compile,
                                 **(ENGINE_LIMITS | {"dtype": "bfloat16"} | limits)))
    assert engine.model.lora_grouped_from == compile_policy.LORA_GROUPED_MIN_TOKENS
    for name, path in adapters["llama"].items():
        engine.adapters.register(name, str(path))
    engine.warmup()
    return engine


def _record_steps(engine, monkeypatch) -> list:
    steps = []
    real_forward_batch = engine._forward_batch
    monkeypatch.setattr(engine, "_forward_batch", lambda inputs: steps.append(real_forward_batch(inputs)) or steps[-1])
    return steps


NAMES = ["all4", "qv8"]


def test_long_steps_take_grouped_lora_and_agree_with_transformers(models, adapters, monkeypatch):
    """In bfloat16 on the CPU a step of LORA_GROUPED_MIN_TOKENS tokens or more (a long prefill chunk) runs its LoRA
    as grouped GEMMs over per-slot segments, shorter ones (decode) indexed; the tokens agree with PEFT's. Lowered to
    8 here, so the two prompts' prefill (15 tokens) is grouped and their decode steps are not."""
    monkeypatch.setattr(compile_policy, "LORA_GROUPED_MIN_TOKENS", 8)
    engine = _grouped_engine(models, adapters, compile=False)
    steps = _record_steps(engine, monkeypatch)
    ours = engine.generate([PROMPT, PROMPT], SamplingParams(max_new_tokens=AGREE, ignore_eos=True), adapters=NAMES)
    grouped = [fb.lora.segment_offsets is not None for fb in steps]
    assert grouped[0] and not any(grouped[1:]), grouped  # the prefill step only
    for tokens, name in zip(ours, NAMES):
        ref, _ = reference_greedy(models["llama"], PROMPT, AGREE, adapters["llama"][name], torch.bfloat16)
        assert len(set(ref)) >= AGREE // 2, f"degenerate reference {ref}"
        assert tokens == ref, name


def test_grouped_prefill_compiles_into_a_third_graph(models, adapters, monkeypatch):
    """Compiled, warm-up traces the grouped variant too: the steps after it never recompile (the engine fails on
    one), and the grouped prefill's logits are the eager engine's within bfloat16 rounding (the compiled kernels
    sum in another order: the bound is 0.5 on logits of magnitude ~12, with the same greedy token). The threshold
    (the two prompts' 14 tokens) exceeds max_seq_len here, so warm-up's long step is several prompts."""
    monkeypatch.setattr(compile_policy, "LORA_GROUPED_MIN_TOKENS", 2 * len(PROMPT))
    logits = []
    for compile in (False, True):
        engine = _grouped_engine(models, adapters, compile, max_seq_len=len(PROMPT) + 5)
        steps = _record_steps(engine, monkeypatch)
        seqs = [Sequence(i, PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True), n) for i, n in enumerate(NAMES)]
        for seq in seqs:
            assert engine.try_admit(seq)
        logits.append(engine.step(seqs, return_logits=True).logits.float())
        while not all(s.is_finished for s in seqs):
            engine.step(seqs)
        assert [fb.lora.segment_offsets is not None for fb in steps] == [True, False, False, False]
    torch.testing.assert_close(logits[1], logits[0], atol=0.5, rtol=0)
    assert torch.equal(logits[1].argmax(-1), logits[0].argmax(-1))
