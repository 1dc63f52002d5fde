"""GGUF models (lora_compile/model/loader/gguf_checkpoint.py): a tiny llama written with the gguf writer in every supported
tensor type gives exactly the greedy tokens of transformers' own GGUF loading, base and with a PEFT adapter in one
batch; its tokenizer is the one it was written from; refusals name what is wrong."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoTokenizer

from lora_compile import Engine, EngineConfig
from lora_compile.errors import CheckpointError
from lora_compile.model.loader.gguf_checkpoint import GGUFCheckpoint
from lora_compile.tokenizer import Tokenizer
from lora_serve_demo import EOS_ID
from tests.conftest import ENGINE_LIMITS
from tests.gguf_files import assert_batch_equals_reference, tiny_llama_gguf, write_gguf
from tests.test_engine_golden import NEW_TOKENS, PROMPTS, run_joining

# Every supported type at least once: K-quants need rows of 256 values (down_proj's input, intermediate 256).
TYPES = {"blk.0.ffn_down.weight": Q.Q4_K, "blk.1.ffn_down.weight": Q.Q5_K, "blk.2.ffn_down.weight": Q.Q6_K,
         "attn_q.weight": Q.Q8_0, "attn_k.weight": Q.Q4_0, "attn_v.weight": Q.Q4_1, "attn_output.weight": Q.F16,
         "ffn_gate.weight": Q.BF16, "ffn_up.weight": Q.Q5_1, "token_embd.weight": Q.Q8_0, "output.weight": Q.Q5_0}
TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the Hugging Face directory it was written from, the GGUF file, a PEFT adapter on all seven projections)."""
    return tiny_llama_gguf(tmp_path_factory.mktemp("gguf"), "tiny-llama.gguf", TYPES, hidden=64, intermediate=256,
                           layers=3, seed=5, rank=4, adapter_seed=21, chat_template=TEMPLATE)


def test_every_type_is_in_the_file(tiny):
    _, path, _ = tiny
    ckpt = GGUFCheckpoint(path)
    types = {t.tensor_type.name for t in ckpt._reader.tensors}
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"} <= types
    down = ckpt.get("model.layers.0.mlp.down_proj.weight", (64, 256))
    assert 0.01 < down.std() < 1 and torch.isfinite(down).all()  # the synthetic K-quant blocks are weight-like


@pytest.mark.parametrize("prepack", [True, False], ids=["packed", "plain"])
def test_greedy_tokens_equal_transformers_gguf_loading_base_and_adapter(tiny, prepack):
    _, path, adapter = tiny
    engine = Engine(EngineConfig(model=str(path), compile=False, prepack_weights=prepack, **ENGINE_LIMITS))
    engine.adapters.register("all7", str(adapter))
    engine.warmup()
    assert engine.model_name == "tiny-llama"
    assert_batch_equals_reference(engine, path, adapter)


def test_tokenizer_and_chat_template_come_from_the_file(tiny):
    hf_dir, path, _ = tiny
    engine = Engine(EngineConfig(model=str(path), compile=False, **ENGINE_LIMITS))
    original = Tokenizer(hf_dir)
    texts = ["The quick brown fox, 12 times!", "  spaces\tand\nnewlines ", "naïve café 😀", "</s> <s> plain"]
    for text in texts:
        assert engine.tokenizer.encode(text) == original.encode(text), text
        assert engine.tokenizer.decode(engine.tokenizer.encode(text)) == original.decode(original.encode(text))
    assert engine.tokenizer.eos_token_ids == {EOS_ID}
    config = json.loads((engine.tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == TEMPLATE and config["eos_token"] == "</s>"
    # transformers' own GGUF tokenizer agrees on the same file (its BOS handling aside)
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in texts:
        assert engine.tokenizer.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)


def test_tokenizer_override(tiny, tmp_path):
    hf_dir, path, _ = tiny
    engine = Engine(EngineConfig(model=str(path), tokenizer=str(hf_dir), compile=False, **ENGINE_LIMITS))
    assert engine.tokenizer_dir == hf_dir


def test_unsupported_type_is_one_line_naming_it(tiny, tmp_path):
    import gguf
    hf_dir, _, _ = tiny
    bad = write_gguf(hf_dir, tmp_path / "bad.gguf", {})
    # Rewrite one tensor's type in place: IQ4_NL blocks are 18 bytes per 32 values, as Q4_0's (same size).
    reader = gguf.GGUFReader(str(write_gguf(hf_dir, tmp_path / "q40.gguf", {"attn_q.weight": Q.Q4_0})))
    tensor = next(t for t in reader.tensors if t.tensor_type == Q.Q4_0)
    field_offset = tensor.field.offset + sum(p.nbytes for p in tensor.field.parts[:-2])  # the type is 2nd-to-last part
    data = bytearray((tmp_path / "q40.gguf").read_bytes())
    data[field_offset:field_offset + 4] = np.uint32(Q.IQ4_NL).tobytes()
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"tensor type IQ4_NL is not supported; supported: F32"):
        GGUFCheckpoint(bad)
    proc = subprocess.run([sys.executable, "-m", "service", "--no-compile", "--model", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "IQ4_NL is not supported" in errors[0], proc.stderr[-2000:]


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"NOTGGUF" + bytes(100))
    with pytest.raises(CheckpointError, match="not a model directory or a GGUF file"):
        Engine(EngineConfig(model=str(path), compile=False, **ENGINE_LIMITS))


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_other_architectures_equal_the_checkpoint_they_were_written_from(tmp_path, arch):
    """Files of qwen2 (qkv biases) and qwen3 (q/k norms, head_dim apart from hidden / heads), which llama.cpp stores
    without the llama permute, in float32: the engine's greedy tokens are transformers' on the Hugging Face checkpoint
    the file was written from (transformers' own GGUF loading reads no head_dim for qwen3: it cannot load this one)."""
    from tests.checkpoints import make_tiny_model, reference_greedy

    hf_dir = make_tiny_model(tmp_path / "hf", arch, seed=7)
    path = write_gguf(hf_dir, tmp_path / f"tiny-{arch}.gguf", {}, arch=arch)
    engine = Engine(EngineConfig(model=str(path), compile=False, **ENGINE_LIMITS))
    assert engine.model_config.architecture == {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    tokens, _ = run_joining(engine, PROMPTS[:2], join_at=[0, 1])
    for prompt, got in zip(PROMPTS[:2], tokens):
        expected, _ = reference_greedy(hf_dir, prompt, NEW_TOKENS)
        assert len(set(expected)) > 4 and got == expected
