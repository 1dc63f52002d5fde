"""DoRA adapters (use_dora): each output row of W + B·A rescaled to the adapter's magnitude, exactly as PEFT
computes it, in one batch with plain LoRA adapters and the base model; merged when it runs alone; refused where
the base is quantized; a magnitude never dropped or made up."""
from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from lora_compile.errors import AdapterError
from tests.checkpoints import make_peft_adapter, reference_greedy
from tests.conftest import build_engine
from tests.test_engine_golden import NEW_TOKENS, PROMPTS, assert_matches_reference, run_joining
from tests.test_lora_merge import recording_steps, run_lone

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MIXED = [None, "dora", "qv8", "dora-qv"]  # base, DoRA on every projection, plain LoRA, DoRA on part of the fused qkv


@pytest.fixture(scope="module")
def dora_adapters(models, adapters, tmp_path_factory):
    root = tmp_path_factory.mktemp("dora")
    return {arch: {"dora": make_peft_adapter(base, root / arch / "dora", r=8, lora_alpha=16, target_modules=ALL,
                                             seed=21, use_dora=True),
                   "dora-qv": make_peft_adapter(base, root / arch / "dora-qv", r=4, lora_alpha=4, use_rslora=True,
                                                target_modules=("q_proj", "v_proj"), seed=22, use_dora=True),
                   "qv8": adapters[arch]["qv8"]}
            for arch, base in models.items()}


def _as_plain_lora(dora_dir, out_dir):
    """The same A and B without the magnitudes: what serving a DoRA adapter as a plain LoRA would compute."""
    shutil.copytree(dora_dir, out_dir)
    tensors = load_file(out_dir / "adapter_model.safetensors")
    save_file({k: v for k, v in tensors.items() if "lora_magnitude_vector" not in k},
              out_dir / "adapter_model.safetensors")
    config = json.loads((out_dir / "adapter_config.json").read_text())
    (out_dir / "adapter_config.json").write_text(json.dumps(config | {"use_dora": False}))
    return out_dir


def check_mixed(engine, model_dir, dirs):
    tokens, logits = run_joining(engine, PROMPTS, adapters=MIXED, join_at=[0, 0, 1, 2])
    assert_matches_reference(model_dir, PROMPTS, tokens, logits, [dirs[n] if n else None for n in MIXED])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biased qkv, where PEFT rescales without the bias
def test_dora_in_a_mixed_batch_matches_peft_eager(models, dora_adapters, arch, tmp_path):
    dirs = dora_adapters[arch]
    engine = build_engine(models[arch], dirs, compile=False)
    check_mixed(engine, models[arch], dirs)
    # Non-degenerate: the magnitudes change the tokens (served as plain LoRA, the adapter answers otherwise).
    plain = _as_plain_lora(dirs["dora"], tmp_path / "plain")
    prompt = PROMPTS[0]
    assert (reference_greedy(models[arch], prompt, NEW_TOKENS, dirs["dora"])[0]
            != reference_greedy(models[arch], prompt, NEW_TOKENS, plain)[0])


def test_dora_in_a_mixed_batch_matches_peft_compiled(models, adapters, dora_adapters, compiled_engines):
    """On the shared compiled engine: the same graph serves DoRA slots (no recompile: fail_on_recompile)."""
    engine, dirs = compiled_engines("llama"), dora_adapters["llama"]
    for name in ("dora", "dora-qv"):
        engine.adapters.register(name, str(dirs[name]))
    try:
        check_mixed(engine, models["llama"], dirs)
    finally:
        for name in ("dora", "dora-qv"):
            engine.adapters.unregister(name)
    # Slot reuse: plain adapters copied into the slots DoRA adapters held compute plain LoRA again.
    names = ["qv8", "all4", "mlp16rs"]
    tokens, logits = run_joining(engine, PROMPTS[:3], adapters=names, join_at=[0, 0, 0])
    assert_matches_reference(models["llama"], PROMPTS[:3], tokens, logits, [adapters["llama"][n] for n in names])


def test_lone_dora_adapter_runs_merged_and_matches_peft(models, dora_adapters):
    model_dir, dirs = models["llama"], dora_adapters["llama"]
    engine = build_engine(model_dir, dirs, compile=False, merge_lone_adapter="on", merge_after_steps=3)
    outputs = recording_steps(engine)
    assert any(run_lone(engine, model_dir, "dora", dirs["dora"], outputs)), "no step ran merged"


def test_dora_is_refused_on_a_quantized_base(models, dora_adapters):
    engine = build_engine(models["llama"], {}, compile=False, quantization="int8")
    with pytest.raises(AdapterError, match="use_dora.*--quantization none"):
        engine.adapters.register("dora", str(dora_adapters["llama"]["dora"]))
    engine.adapters.register("qv8", str(dora_adapters["llama"]["qv8"]))  # plain LoRA still loads there


@pytest.mark.parametrize("case", ["missing", "extra", "shape"])
def test_magnitudes_are_never_dropped_or_made_up(dora_adapters, models, tmp_path, case):
    dora = dora_adapters["llama"]["dora"]
    bad = shutil.copytree(dora, tmp_path / case)
    tensors = load_file(bad / "adapter_model.safetensors")
    config = json.loads((bad / "adapter_config.json").read_text())
    key = next(k for k in tensors if "lora_magnitude_vector" in k)
    if case == "missing":    # use_dora, one magnitude gone
        del tensors[key]
        expected = "lora_magnitude_vector is missing"
    elif case == "extra":    # magnitudes, but use_dora false: would silently compute another adapter
        config["use_dora"] = False
        expected = "lora_magnitude_vector is present"
    else:
        tensors[key] = tensors[key][:-1].contiguous()
        expected = "must be .* finite values"
    save_file(tensors, bad / "adapter_model.safetensors")
    (bad / "adapter_config.json").write_text(json.dumps(config))
    engine = build_engine(models["llama"], {}, compile=False)
    with pytest.raises(AdapterError, match=expected):
        engine.adapters.register("bad", str(bad))
