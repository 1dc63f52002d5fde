"""--kv-cache-dtype bfloat16 with a float32 model: the pool holds bfloat16 keys and values (twice the tokens in one
budget) and attention computes in float32 over them. Exactly transformers + PEFT in float32 with its KV cache
rounded to bfloat16 as it is written, token for token, base model and adapters in one batch joining at different
steps; and the rounding is real (the logits differ from the float32 pool's). The engine runs eager here: the
compiled decode attention over bfloat16 pools is tested in test_attention (both forms), and a compiled engine with
this pool is one more cold compile of the tiny model (~70 s of a 2-core suite that must stay short)."""
from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from lora_compile import Engine, EngineConfig
from lora_compile.kv_cache.sizing import bytes_per_block
from service.cli import _engine_config, serve_parser
from tests.conftest import ENGINE_LIMITS
from tests.test_engine_golden import PROMPTS, assert_matches_reference, run_joining
from tests.test_lora import MIXED

BUDGET = 2 << 20  # bytes of KV: the same budget for both pools


def _engine(models, adapters, kv_cache_dtype: str) -> Engine:
    engine = Engine(EngineConfig(model=str(models["llama"]), compile=False, kv_cache_dtype=kv_cache_dtype,
                                 **(ENGINE_LIMITS | {"kv_cache_memory": BUDGET})))
    for name, path in adapters["llama"].items():
        engine.adapters.register(name, str(path))
    return engine


@pytest.fixture
def bf16_kv_reference(monkeypatch):
    """transformers' cache rounds what it stores, and what this step attends to, to bfloat16, as our pool does."""
    update = DynamicLayer.update

    def rounded(self, key_states, value_states, *args, **kwargs):
        return update(self, key_states.to(torch.bfloat16).float(), value_states.to(torch.bfloat16).float(),
                      *args, **kwargs)

    monkeypatch.setattr(DynamicLayer, "update", rounded)


def test_bfloat16_pool_equals_transformers_with_its_cache_rounded(models, adapters, bf16_kv_reference):
    bf16 = _engine(models, adapters, "bfloat16")
    f32 = _engine(models, adapters, "auto")
    attn = bf16.model.layers[0].self_attn
    assert (attn.k_cache.dtype, attn.v_cache.dtype, bf16.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)
    # Half the bytes a token: twice the blocks from one budget.
    per_block = bytes_per_block(bf16.model.config, bf16.kv_cache.block_size, torch.float32)
    assert per_block == 2 * bytes_per_block(bf16.model.config, bf16.kv_cache.block_size, torch.bfloat16)
    assert bf16.kv_cache.num_blocks == BUDGET // (per_block // 2) - 1
    assert f32.kv_cache.num_blocks == BUDGET // per_block - 1
    tokens, logits = run_joining(bf16, PROMPTS, adapters=MIXED)
    _, f32_logits = run_joining(f32, PROMPTS, adapters=MIXED)
    # (the reference's cache rounds: bf16_kv_reference)
    assert_matches_reference(models["llama"], PROMPTS, tokens, logits,
                             [adapters["llama"][name] if name else None for name in MIXED])
    for i in range(len(PROMPTS)):
        n = min(len(logits[i]), len(f32_logits[i]))
        assert not torch.equal(logits[i][:n], f32_logits[i][:n]), "the bfloat16 pool rounded nothing"
    assert bf16.kv_cache.usage == 0


def test_the_flag_reaches_the_engine_and_bad_values_are_refused(capsys):
    parser = serve_parser()
    args = parser.parse_args(["--model", "m", "--kv-cache-dtype", "bfloat16"])
    assert _engine_config(args, "m").kv_cache_dtype == "bfloat16"
    assert _engine_config(parser.parse_args(["--model", "m"]), "m").kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--kv-cache-dtype", "fp8"])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16"):
        EngineConfig(model="m", kv_cache_dtype="int8")
