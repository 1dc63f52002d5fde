"""GGUF files for tests, written with the `gguf` package's own writer (as llama.cpp's convert_hf_to_gguf does):
a tiny Hugging Face checkpoint's tensors under llama.cpp's names, Q/K rows permuted as llama.cpp stores them, each
tensor in the type asked for, and the checkpoint's byte-level BPE tokenizer as metadata."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file

# Bytes per 256-value block, and the offsets of its float16 scales, for the K-quants gguf can only read: their
# tests fill blocks with seeded random bytes and set the scales so values stay in a weight's range.
_K_BLOCKS = {Q.Q4_K: (144, {0: 2e-4, 2: 1e-3}), Q.Q5_K: (176, {0: 1e-4, 2: 1e-3}), Q.Q6_K: (210, {208: 2.5e-5})}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute of Q/K rows (rotary halves interleaved per head)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _k_quant_bytes(shape: tuple[int, ...], qtype: Q, seed: int) -> np.ndarray:
    block, scales = _K_BLOCKS[qtype]
    rows, cols = shape
    assert cols % 256 == 0, "K-quants pack rows of 256 values"
    data = np.random.default_rng(seed).integers(0, 256, size=(rows, cols // 256, block), dtype=np.uint8)
    for offset, value in scales.items():
        data[:, :, offset:offset + 2] = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
    return data.reshape(rows, -1)


def write_gguf(model_dir: Path, out: Path, types: dict[str, Q], default: Q = Q.F32,
               chat_template: str | None = None, arch: str = "llama") -> Path:
    """`model_dir` (a tiny llama or qwen3 checkpoint with tokenizer.json) as a GGUF file of `arch`. `types`: a GGUF
    tensor-name suffix (e.g. "blk.0.attn_q.weight" or "attn_q.weight") -> its type; 1-D tensors stay F32, as
    llama.cpp keeps them."""
    cfg = json.loads((model_dir / "config.json").read_text())
    tensors = load_file(str(model_dir / "model.safetensors"))
    n_layers, heads, kv_heads = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), n_layers)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(n_layers)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(cfg["vocab_size"])
    _add_tokenizer(writer, model_dir, cfg, chat_template)
    for seed, (hf_name, value) in enumerate(sorted(tensors.items())):
        base, _, suffix = hf_name.rpartition(".")
        name = f"{names.get_name(base)}.{suffix}"
        w = value.astype(np.float32)
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):  # llama.cpp permutes llama's only
            w = _permute(w, heads if "attn_q" in name else kv_heads)
        qtype = Q.F32 if w.ndim == 1 else next((t for s, t in types.items() if name.endswith(s)), default)
        if qtype in _K_BLOCKS:
            writer.add_tensor(name, _k_quant_bytes(w.shape, qtype, seed), raw_dtype=qtype)
        elif qtype == Q.F32:
            writer.add_tensor(name, w)
        elif qtype == Q.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, cfg: dict, chat_template: str | None) -> None:
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = [None] * cfg["vocab_size"]
    for token, index in vocab.items():
        tokens[index] = token
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    for index, t in added.items():
        tokens[index] = t["content"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in added and added[i].get("special") else 1 for i in range(len(tokens))])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_add_bos_token(True)  # the demo tokenizer prepends <s>
    if chat_template:
        writer.add_chat_template(chat_template)


def load_gguf_reference(path: Path, adapter_dir: Path | None = None, adapter_name: str = "default"):
    """transformers' own GGUF loading (dequantised to float32), + peft: the reference the engine is compared with."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="eager")
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir, adapter_name=adapter_name)
    return model.eval()


ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_llama_gguf(root: Path, name: str, types: dict[str, Q], *, hidden: int, intermediate: int, layers: int,
                    seed: int, rank: int, adapter_seed: int, chat_template: str | None = None):
    """A random tiny Llama (`root/hf`, with the demo tokenizer) written as the GGUF file `root/files/name` with
    `types`, and a PEFT adapter of `rank` on all seven projections: (the directory, the file, the adapter)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lora_serve_demo import BOS_ID, EOS_ID, VOCAB_SIZE, write_demo_tokenizer
    from tests.checkpoints import _init_weights, make_peft_adapter

    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, rms_norm_eps=1e-5,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    model = LlamaForCausalLM(config)
    _init_weights(model, seed=seed)
    model.save_pretrained(root / "hf")
    write_demo_tokenizer(root / "hf")
    path = write_gguf(root / "hf", root / "files" / name, types, chat_template=chat_template)
    adapter = make_peft_adapter(root / "hf", root / "adapter", r=rank, lora_alpha=2 * rank, seed=adapter_seed,
                                target_modules=ALL_PROJECTIONS)
    return root / "hf", path, adapter


def assert_batch_equals_reference(engine, path: Path, adapter: Path, name: str = "all7") -> None:
    """Base and adapter `name` (registered) in one batch over the golden prompts: the engine's greedy tokens and
    logits equal transformers' GGUF loading of `path` (+ peft with `adapter`)."""
    import torch

    from tests.checkpoints import greedy
    from tests.test_engine_golden import NEW_TOKENS, PROMPTS, run_joining

    mixed = [None, name, None, name]
    tokens, logits = run_joining(engine, PROMPTS, adapters=mixed)
    references = {None: load_gguf_reference(path), name: load_gguf_reference(path, adapter)}
    for i, prompt in enumerate(PROMPTS):
        ref_tokens, ref_logits = greedy(references[mixed[i]], prompt, NEW_TOKENS)
        assert len(set(ref_tokens)) > 4, "degenerate reference: the test would prove nothing"
        assert tokens[i] == ref_tokens, f"sequence {i} ({mixed[i]}) differs from transformers' GGUF loading + peft"
        torch.testing.assert_close(logits[i], ref_logits, atol=2e-3, rtol=1e-3)
    assert tokens[0] != tokens[1] or tokens[2] != tokens[3]  # the adapter changes the output
