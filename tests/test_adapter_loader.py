"""The adapter reader without torch ops (numpy + safetensors' parser): half-precision files convert to exactly
what torch's conversion gives, unsupported dtypes and bad names are refused with a precise message."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.common import write_lora_adapter
from lora_compile.lora.adapters import check_adapter_name, load_adapter
from lora_compile.config import ModelConfig
from lora_compile.errors import AdapterError, AdapterNameError
from tests.service_harness import demo_paths


@pytest.fixture(scope="module")
def base():
    model, _ = demo_paths()
    return model, ModelConfig.from_dir(model)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_half_precision_weights_convert_exactly(base, tmp_path, dtype):
    model, cfg = base
    src = write_lora_adapter(model, tmp_path / "a", rank=8, seed=3, modules=("q_proj", "v_proj"))
    weights = src / "adapter_model.safetensors"
    tensors = {k: v.to(dtype) for k, v in load_file(str(weights)).items()}
    save_file(tensors, str(weights))
    adapter = load_adapter("a", src, cfg, 16)
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_{}.weight"
    a, b = adapter.weights[1]["v_proj"]
    assert a.dtype == torch.float32 and torch.equal(a, tensors[key.format("A")].float())
    assert torch.equal(b, tensors[key.format("B")].float() * (16 / 8))  # lora_alpha 2r / r


def test_integer_weights_are_refused(base, tmp_path):
    model, cfg = base
    src = write_lora_adapter(model, tmp_path / "a", rank=8, seed=3, modules=("q_proj",))
    weights = src / "adapter_model.safetensors"
    save_file({k: v.to(torch.int32) for k, v in load_file(str(weights)).items()}, str(weights))
    with pytest.raises(AdapterError, match="dtype I32 is not supported"):
        load_adapter("a", src, cfg, 16)


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "a/b", "a\\b", ".env", "-x", "a\x00b", "pirate\n", "a b",
                                  "x" * 129, "Ünïcode", "pirate\u202e", "\u200fpirate"])
def test_bad_adapter_names(name):
    """One rule, one message: what it may hold, with the name escaped (the NUL, newline and right-to-left marks
    shown as escapes, never printed raw)."""
    with pytest.raises(AdapterNameError, match="use 1 to 128 letters, digits") as info:
        check_adapter_name(name)
    assert str(info.value).isprintable()


def test_good_adapter_names():
    for name in ("tenant-001", "customer_42.v2", "x" * 128, "a..b", "Pirate.2", "0"):
        check_adapter_name(name)
