"""Model families beyond Llama (lora_compile/model/families.py): Qwen3, Phi-3, Gemma 2, Gemma 3. Per family, one batch mixing the
base model and two PEFT adapters, joining at different steps, gives exactly transformers' + peft's greedy tokens
and close logits, eager and compiled; their config.json read in transformers 5's form and in the older one give
the same ModelConfig."""
from __future__ import annotations

import functools
import json

import pytest
import torch

from lora_compile.config import ModelConfig
from lora_compile.lora.adapter_config import targets_from_config
from lora_compile.errors import AdapterError, CheckpointError
from lora_compile.model.layers import rope_tables
from lora_compile.model.causal_lm import lora_targets
from tests.checkpoints import ALL_TARGETS, UNFUSED_TARGETS, make_peft_adapter, make_tiny_model, reference_greedy
from tests.conftest import build_engine
from tests.test_engine_golden import NEW_TOKENS, PROMPTS, run_joining

FAMILIES = ["qwen3", "phi3", "gemma2", "gemma3"]
# Untied: a tiny Gemma's tied head echoes its (sqrt(hidden)-scaled) input token. (Tying is Qwen2's path, tested.)
_MODEL = {"gemma3": dict(num_layers=3)}
_ATTENTION = {"phi3": ("qkv_proj",)}
MIXED = [None, "all", "attn", "all"]


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    """Per family: its tiny checkpoint and two adapters (every projection, rank 8; attention only, rsLoRA rank 4)."""
    root = tmp_path_factory.mktemp("families")
    made = {}
    for arch in FAMILIES:
        base = make_tiny_model(root / arch, arch, seed=5, **_MODEL.get(arch, {}))
        adapters = {
            "all": make_peft_adapter(base, root / f"{arch}-all", r=8, lora_alpha=16, seed=21,
                                     target_modules=ALL_TARGETS.get(arch, UNFUSED_TARGETS)),
            "attn": make_peft_adapter(base, root / f"{arch}-attn", r=4, lora_alpha=8, use_rslora=True, seed=22,
                                      target_modules=_ATTENTION.get(arch, ("q_proj", "k_proj", "v_proj"))),
        }
        made[arch] = (base, adapters)
    return made


@functools.cache
def _reference(model_dir, prompt: tuple[int, ...], adapter_dir) -> tuple[list[int], torch.Tensor]:
    """transformers + peft's greedy tokens and logits, computed once for the eager and the compiled test."""
    return reference_greedy(model_dir, prompt, NEW_TOKENS, adapter_dir)


def check_family(engine, base, adapters):
    tokens, logits = run_joining(engine, PROMPTS, adapters=MIXED, join_at=[0, 1, 1, 3])
    for i, (prompt, name) in enumerate(zip(PROMPTS, MIXED)):
        ref_tokens, ref_logits = _reference(base, tuple(prompt), adapters[name] if name else None)
        assert len(set(ref_tokens)) > 4, "degenerate reference: the test would prove nothing"
        assert tokens[i] == ref_tokens, f"sequence {i} (adapter {name}) differs from the reference"
        torch.testing.assert_close(logits[i], ref_logits, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("arch", FAMILIES)
def test_family_eager_matches_transformers_and_peft(family_models, arch):
    base, adapters = family_models[arch]
    check_family(build_engine(base, adapters, compile=False), base, adapters)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["phi3", "gemma2", "gemma3"])
def test_family_compiled_matches_transformers_and_peft(family_models, arch):
    """Compiled: warm-up traces every layer kind (per-layer window and rotary table are tensors), and the steps
    after it run under fail_on_recompile (Engine.step). Qwen3 compiled adds nothing Gemma 3's does not run (q/k
    norms in the compiled layer) and costs a minute of the suite: its eager test covers what it declares. The
    saved stack (precompile) is tested in test_engine_compile: not saved here."""
    base, adapters = family_models[arch]
    check_family(build_engine(base, adapters, compile=True, precompile=False), base, adapters)


def test_longrope_tables_match_transformers(family_models):
    """Phi-3's rotary tables, cos/sin scaled by the attention factor, short factors below
    original_max_position_embeddings and long ones from it on: what transformers computes for a forward whose last
    position is that one. (transformers' generate also recomputes a sequence's cached keys with the long factors
    when it crosses over; the engine keeps them, as vLLM does.)"""
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    base, _ = family_models["phi3"]
    reference = Phi3RotaryEmbedding(AutoConfig.from_pretrained(base))
    cfg = ModelConfig.from_dir(base)
    cos, sin = rope_tables(cfg, 80, torch.float32, torch.device("cpu"))
    assert cos.shape == (80, cfg.rotary_dim) and cfg.rotary_dim < cfg.head_dim
    for pos in (0, 1, 40, 63, 64, 65, 79):
        ref_cos, ref_sin = reference(torch.zeros(1, 1, cfg.head_dim), torch.tensor([[pos]]))
        torch.testing.assert_close(cos[pos], ref_cos[0, 0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sin[pos], ref_sin[0, 0], rtol=1e-6, atol=1e-6)


def _older_form(raw: dict) -> dict:
    """config.json as transformers 4 wrote it: rope_theta / rope_scaling / rope_local_base_freq, no layer_types."""
    old = {k: v for k, v in raw.items() if k not in ("rope_parameters", "layer_types")}
    rope = dict(raw.get("rope_parameters") or {})
    if "full_attention" in rope:  # Gemma 3: sliding layers' base apart, and a pattern instead of layer_types
        old["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        old["sliding_window_pattern"] = 2
        rope = dict(rope["full_attention"])
    old["rope_theta"] = rope.pop("rope_theta", 10000.0)
    old["partial_rotary_factor"] = rope.pop("partial_rotary_factor", 1.0)
    if rope.get("rope_type", "default") != "default":
        rope["type"] = rope.pop("rope_type")
        old["rope_scaling"] = rope
    return old


@pytest.mark.parametrize("arch", FAMILIES)
def test_config_read_in_both_forms(family_models, arch):
    base, _ = family_models[arch]
    raw = json.loads((base / "config.json").read_text())
    new, old = ModelConfig.from_dict(raw), ModelConfig.from_dict(_older_form(raw))
    assert new == old
    assert new.architecture == raw["architectures"][0] and new.family is ModelConfig.from_dict(raw).family
    if arch.startswith("gemma"):
        assert set(new.layer_types) == {"sliding_attention", "full_attention"} and new.mixed_layers


def test_fused_targets_are_phi3s_own(family_models):
    """Phi-3's adapters target its packed modules; q_proj (which its checkpoints lack) is refused, and the other
    families keep q/k/v."""
    phi3 = ModelConfig.from_dir(family_models["phi3"][0])
    assert list(lora_targets(phi3)) == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    assert targets_from_config({"target_modules": "all-linear"}, "a", lora_targets(phi3)) == tuple(lora_targets(phi3))
    with pytest.raises(AdapterError, match="'q_proj'"):
        targets_from_config({"target_modules": ["q_proj", "v_proj"]}, "a", lora_targets(phi3))
    qwen3 = ModelConfig.from_dir(family_models["qwen3"][0])
    with pytest.raises(AdapterError, match="'qkv_proj'"):
        targets_from_config({"target_modules": ["qkv_proj"]}, "a", lora_targets(qwen3))


def test_unsupported_architecture_is_refused_by_name(family_models):
    raw = json.loads((family_models["qwen3"][0] / "config.json").read_text()) | {"architectures": ["OlmoForCausalLM"]}
    with pytest.raises(CheckpointError, match="unsupported architecture 'OlmoForCausalLM'"):
        ModelConfig.from_dict(raw)
