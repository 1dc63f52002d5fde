"""int8 weights with a scale a row on a CPU with AMX (lora_compile/model/quantization/amx_int8.py): held once in the
layout of Inductor's AMX micro-kernel, their products run its template at every row count, compiled in the engine's
one graph."""
from __future__ import annotations

import pytest
import torch

from lora_compile import compile_policy
from lora_compile.config import EngineConfig
from lora_compile.core.engine import Engine
from lora_compile.model import quantization as qz
from tests.checkpoints import make_peft_adapter, make_tiny_model
from tests.conftest import ENGINE_LIMITS, INDUCTOR_CACHE
from tests.test_engine_golden import PROMPTS, run_joining

CPU = torch.device("cpu")
AMX_INT8 = qz.amx_int8.usable(128, 256, torch.bfloat16, CPU)
pytestmark = pytest.mark.skipif(not AMX_INT8, reason="Inductor's AMX template needs a CPU with AMX")


def test_int8_rows_take_the_amx_template_at_every_row_count():
    """int8 a scale a row in bfloat16 on a CPU with AMX is held once, in the blocked layout Inductor's AMX
    micro-kernel reads (what Inductor makes of a frozen weight for it), and its product runs that template compiled
    at every row count, in one graph without a recompile, and widened eager: each within bfloat16's bound of the
    dequantised product, the step's padding row left out (zeros)."""
    from torch._inductor.codegen.cpp_gemm_template import CppGemmTemplate
    from torch._inductor.codegen.cpp_micro_gemm import CppMicroGemmAMX
    from torch._inductor.codegen.cpp_utils import GemmBlocking
    from torch._inductor.utils import run_and_get_code

    n, k = 192, 256
    qt = qz.quantize_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(8)) * 0.05)
    codes, scales = qz.pack(qt, torch.bfloat16, CPU)
    assert codes.shape == (n // 32, k, 32) and torch.equal(qz.amx_int8.codes_of(codes), qt.codes)
    micro_gemm = CppMicroGemmAMX("m", torch.bfloat16, torch.int8, torch.float, torch.float, GemmBlocking(32, 32, 32), 1)
    inductors = CppGemmTemplate.pack_vnni_weight(CppGemmTemplate.block_weight(qt.codes.t(), [n // 32, k, 32], 0),
                                                 micro_gemm, [n // 32, k, 32])
    assert torch.equal(codes, inductors)
    torch._dynamo.reset()
    product = torch.compile(lambda x, c, s: qz.linear(x, "int8", c, s, 0, 1), fullgraph=True)
    for i, tokens in enumerate((5, 2, 9, 48, qz.KERNEL_MAX_TOKENS + 20, 600)):
        x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(tokens))
        x_bf16 = x.bfloat16()
        torch._dynamo.mark_dynamic(x_bf16, 0)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got, code = run_and_get_code(product, x_bf16, codes, scales)
        assert i > 0 or ("amx_state" in "".join(code) and "ops.lora_serve.int8_mm_tiles" not in "".join(code))
        expected = x[:-1] @ qt.dequantize().T
        for y in (got, qz.linear(x_bf16, "int8", codes, scales, 0, 1)):
            assert not y[-1].any()  # (the padding row: left out, zeros)
            assert ((y[:-1].float() - expected).abs().max() / expected.abs().max()).item() <= 2e-2, tokens


def test_a_compiled_engine_runs_int8_rows_through_the_template_as_eager_computes_them(tmp_path):
    """A bfloat16 checkpoint quantized at load to int8 a scale a row: every projection holds the template's layout,
    and compiled the untied head too (its sampled rows, from one up, in a compiled frame of its own);
    compiled, base and adapter sequences joining at different steps (rows from 1 to a prompt chunk) never recompile
    and give the eager engine's logits (the codes widened for one GEMM, the head at full width) up to where their
    greedy tokens first part,
    within 8 % of the logits' size: on this model compiled and eager bfloat16 part by up to 6 % at full width too
    (Inductor keeps a fused chain's values in float32), where a misread layout or scale is off by the whole size."""
    model_dir = make_tiny_model(tmp_path / "model", seed=5, dtype="bfloat16")
    adapter = make_peft_adapter(model_dir, tmp_path / "adapter", r=8, target_modules=("q_proj", "v_proj", "down_proj"))
    results = {}
    for compiled in (False, True):
        engine = Engine(EngineConfig(model=str(model_dir), compile=compiled, inductor_cache_dir=INDUCTOR_CACHE,
                                     quantization="int8", **(ENGINE_LIMITS | dict(dtype="bfloat16"))))
        projections = [p for layer in engine.model.layers for p, _ in layer.projections()]
        assert all(p.weight is None and p.qweight.dim() == 3 for p in projections)
        # The untied head too where its template runs (compiled: a frame of its own), else full width.
        model = engine.model
        assert (model.head_form.kind, model.lm_head is None, model._head_tiles is not None) == (
            ("int8", True, True) if compiled else ("none", False, False))
        engine.adapters.register("ad", str(adapter))
        engine.warmup()
        with compile_policy.steady_state(compiled):  # (a recompile raises)
            results[compiled] = run_joining(engine, PROMPTS, adapters=[None, "ad", None, "ad"])
        assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    (eager_tokens, eager_logits), (tokens, logits) = results[False], results[True]
    compared = 0
    for i, (a, b) in enumerate(zip(eager_tokens, tokens)):
        same = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        upto = min(same + 1, len(a))  # (the first differing token's logits had the same context)
        error = (logits[i][:upto].float() - eager_logits[i][:upto].float()).abs().max().item()
        scale = eager_logits[i][:upto].float().abs().max().item()
        assert error <= 0.08 * scale, f"sequence {i}: {error:.3f} off at logits up to {scale:.2f}"
        compared += upto
    assert compared >= 4 * len(PROMPTS), "compiled and eager part too early to compare"  # (38 of 128 here)
