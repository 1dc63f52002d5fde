"""A broken checkpoint fails with one clear message naming the file and the tensor."""
from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from lora_compile import Engine, EngineConfig
from lora_compile.errors import CheckpointError


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(d, edit):
    tensors = load_file(d / "model.safetensors")
    edit(tensors)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})


def _load(d, max_seq_len=64):
    return Engine(EngineConfig(model=str(d), compile=False, max_batch_size=2, max_seq_len=max_seq_len))


def test_max_seq_len_is_capped_by_the_models_positions(models):
    """A 512-position model refuses a 700-token context at start, naming both numbers and the flag."""
    with pytest.raises(ValueError, match=r"max_seq_len 700 exceeds the model's max_position_embeddings 512; "
                                         r"set --max-seq-len .* to at most 512"):
        _load(models["llama"], max_seq_len=700)
    assert _load(models["llama"], max_seq_len=512).config.max_seq_len == 512


@pytest.mark.parametrize("case,expected", [
    ("missing-tensor", r"tensor 'model.layers.1.mlp.down_proj.weight' is missing"),
    ("wrong-shape", r"model.safetensors: tensor 'model.layers.0.self_attn.k_proj.weight' has shape \(64, 64\), the config implies \(32, 64\)"),
    ("unsupported-arch", r"config.json: unsupported architecture 'GPT2LMHeadModel'"),
    ("missing-weights", r"no model.safetensors or model.safetensors.index.json"),
    ("pickle-only", r"only pickle \(.bin/.pt\) weights found"),
    ("missing-config", r"config.json: missing"),
    ("missing-tokenizer", r"tokenizer.json: missing"),
    ("bad-json", r"config.json: not valid JSON"),
    ("missing-shard", r"model-00002-of-00002.safetensors: missing weights file"),
])
def test_broken_checkpoints(models, tmp_path, case, expected):
    d = _copy(models["llama"], tmp_path / case)
    if case == "missing-tensor":
        _edit_tensors(d, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    elif case == "wrong-shape":
        _edit_tensors(d, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": t["model.layers.0.self_attn.q_proj.weight"].clone()}))
    elif case == "unsupported-arch":
        _edit_config(d, architectures=["GPT2LMHeadModel"])
    elif case == "missing-weights":
        (d / "model.safetensors").unlink()
    elif case == "pickle-only":
        (d / "model.safetensors").rename(d / "pytorch_model.bin")
    elif case == "missing-config":
        (d / "config.json").unlink()
    elif case == "missing-tokenizer":
        (d / "tokenizer.json").unlink()
    elif case == "bad-json":
        (d / "config.json").write_text("{nope")
    elif case == "missing-shard":
        index = {"weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}
        (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=expected):
        _load(d)
