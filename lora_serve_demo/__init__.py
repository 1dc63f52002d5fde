"""The embedded demo model: a small random Llama checkpoint, its tokenizer and three LoRA adapters.

Everything is generated locally and deterministically (fixed seeds, fixed text), so the service can run
with no model given and no network. The files are ordinary Hugging Face / PEFT directories: transformers
and peft load them too, which is how the tests check the engine against a reference.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from lora_compile.config import ModelConfig, cache_root
from lora_compile.model.causal_lm import LORA_TARGETS, module_shapes

DEMO_VERSION = "demo-v1"
MODEL_DIRNAME = "demo-llama-v1"
ADAPTERS_DIRNAME = "demo-adapters-v1"
MARKER_FILE = ".demo_version"
log = logging.getLogger(__name__)

BOS_TOKEN, EOS_TOKEN = "<s>", "</s>"
BOS_ID, EOS_ID = 0, 1
VOCAB_SIZE = 512  # 2 special + 256 byte tokens + 254 merged tokens
MODEL_MAX_LENGTH = 2048

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 256, 4, 8, 4, 688
HEAD_DIM = HIDDEN // HEADS
MODEL_SEED = 1234

# The text the BPE merges are learnt from; changing it changes the tokenizer (bump DEMO_VERSION).
_MERGE_TEXT = (
    "The quick brown fox jumps over the lazy dog, and then it runs back into the forest where the other "
    "animals are waiting. In the morning the sun rises over the hills and the light falls on the river. "
    "People in the town open their shops, the children walk to school, and the old men sit in the square "
    "talking about the weather and the news of the day. There is a small library near the station with "
    "thousands of books on history, science, poetry and the sea; anyone who wants to learn something new "
    "can go there and read for as long as they like. When the evening comes the streets become quiet again, "
    "the lamps are lit one by one, and the sound of music drifts out of the open windows. This is the story "
    "of a place that is not very different from many others, but the people who live there think that it "
    "is the best place in the whole world, and perhaps they are right, because they have everything they "
    "need: good friends, fresh bread, clean water, and time to enjoy the simple things of life. Some of "
    "them have travelled to distant countries and come home with strange stories about mountains, ships, "
    "storms and kings, which they tell again and again to anyone willing to listen."
)


# ---------------------------------------------------------------------------------------------- paths


default_cache_dir = cache_root  # the demo's files live in lora-serve's cache directory


def _is_complete(path: Path) -> bool:
    marker = path / MARKER_FILE
    return marker.is_file() and marker.read_text().strip() == DEMO_VERSION


def _write_atomically(final: Path, fill: Callable[[Path], None], what: str) -> Path:
    """Create `final` by filling a temp dir next to it and renaming it into place (logged: only then).

    The marker is written last, so a directory with the right marker is always complete; concurrent
    writers produce identical content and whichever rename lands first wins.
    """
    if _is_complete(final):
        return final
    log.info("writing the %s to %s (first run only)", what, final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared with the service's user
        fill(tmp)
        (tmp / MARKER_FILE).write_text(DEMO_VERSION + "\n")
        if final.exists() and not _is_complete(final):
            _discard(final)  # left over from another version or by hand: not ours to trust
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final):  # the rename lost against something other than a twin writer
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _discard(path: Path) -> None:
    # Renaming first keeps the removal atomic from the point of view of other processes.
    aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
    try:
        os.rename(path, aside / path.name)
    except FileNotFoundError:
        pass
    shutil.rmtree(aside, ignore_errors=True)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------------------- tokenizer


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-in for each byte value, indexed by byte (what the ByteLevel pre-tokenizer emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars: list[str] = []
    extra = 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def _merge_pair(symbols: list[str], pair: tuple[str, str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            out.append(symbols[i] + symbols[i + 1])
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return out


def _learn_bpe(text: str, vocab: dict[str, int], size: int) -> list[tuple[str, str]]:
    """Plain BPE on `text`, adding merged tokens to `vocab` until it has `size` entries.

    Ties are broken by the pair itself, so the result never depends on dict or hash order.
    """
    words = Counter(w for w, _ in pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(text))
    splits = {w: list(w) for w in words}
    merges: list[tuple[str, str]] = []
    while len(vocab) < size:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in zip(splits[word], splits[word][1:]):
                pairs[pair] += count
        if not pairs:
            raise ValueError(f"merge text too short for a vocabulary of {size}")
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        vocab.setdefault(best[0] + best[1], len(vocab))
        splits = {w: _merge_pair(s, best) for w, s in splits.items()}
    return merges


def build_demo_tokenizer() -> Tokenizer:
    """Byte-level BPE: any UTF-8 text round-trips; `<s>` is prepended on encode (like Llama)."""
    vocab = {BOS_TOKEN: BOS_ID, EOS_TOKEN: EOS_ID}
    for ch in _bytes_to_unicode():
        vocab[ch] = len(vocab)
    merges = _learn_bpe(_MERGE_TEXT, vocab, VOCAB_SIZE)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B:1", special_tokens=[(BOS_TOKEN, BOS_ID)]
    )
    tok.add_special_tokens([AddedToken(BOS_TOKEN, special=True), AddedToken(EOS_TOKEN, special=True)])
    return tok


def write_demo_tokenizer(out_dir: Path) -> int:
    """Writes tokenizer.json and tokenizer_config.json into `out_dir`; returns the vocabulary size."""
    tok = build_demo_tokenizer()
    tok.save(str(Path(out_dir) / "tokenizer.json"))
    _write_json(Path(out_dir) / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",  # use tokenizer.json as is, no model-specific rewrites
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,  # decode must be the exact inverse of encode
    })
    return tok.get_vocab_size(with_added_tokens=True)


# --------------------------------------------------------------------------------------------- model


def _module_dims(module: str) -> tuple[int, int]:
    """(in_features, out_features) of a linear layer of a decoder layer of the demo model."""
    return module_shapes(ModelConfig.from_dict(_model_config(VOCAB_SIZE)))[module]


def _model_config(vocab_size: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MODEL_MAX_LENGTH,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def _model_shapes(vocab_size: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, HIDDEN)}
    for i in range(LAYERS):
        shapes[f"model.layers.{i}.input_layernorm.weight"] = (HIDDEN,)
        shapes[f"model.layers.{i}.post_attention_layernorm.weight"] = (HIDDEN,)
        for module, path in LORA_TARGETS.items():
            fan_in, fan_out = _module_dims(module)
            shapes[f"model.layers.{i}.{path}.weight"] = (fan_out, fan_in)
    shapes |= {"model.norm.weight": (HIDDEN,), "lm_head.weight": (vocab_size, HIDDEN)}
    return shapes


def _init_std(name: str, shape: tuple[int, ...]) -> float:
    """Large enough that greedy decoding wanders instead of locking onto one token, as it does with a
    real-model init (std 0.02) at this size: sharper attention (q, k) and a strong MLP make the residual
    stream depend on the context."""
    if name.endswith("embed_tokens.weight"):
        return 1.0
    if name == "lm_head.weight":
        return 0.2
    gain = 2.0 if any(m in name for m in ("q_proj", "k_proj", "mlp.")) else 1.0
    return gain / shape[1] ** 0.5


def _demo_weights(vocab_size: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(MODEL_SEED)
    weights = {}
    for name, shape in _model_shapes(vocab_size).items():
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.1 * noise  # not all ones, so a norm that is not loaded shows up
        else:
            weights[name] = noise * _init_std(name, shape)
    return weights


def _fill_model_dir(out: Path) -> None:
    vocab_size = write_demo_tokenizer(out)
    _write_json(out / "config.json", _model_config(vocab_size))
    _write_json(out / "generation_config.json", {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "do_sample": False})
    save_file(_demo_weights(vocab_size), str(out / "model.safetensors"), metadata={"format": "pt"})


def write_demo_checkpoint(cache_dir: Path | None = None) -> Path:
    """`<cache>/demo-llama-v1/`: config, generation config, tokenizer and weights of the demo model."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return _write_atomically(root / MODEL_DIRNAME, _fill_model_dir, "demo model")


# ------------------------------------------------------------------------------------------ adapters


@dataclass(frozen=True)
class DemoAdapter:
    name: str
    r: int
    lora_alpha: int
    target_modules: tuple[str, ...]
    use_rslora: bool
    seed: int
    strength: float  # size of the LoRA update relative to the base layer's output

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (self.r**0.5 if self.use_rslora else self.r)


DEMO_ADAPTERS = (
    DemoAdapter("pirate", r=8, lora_alpha=16, target_modules=("q_proj", "v_proj"), use_rslora=False, seed=11, strength=1.0),
    DemoAdapter("poet", r=16, lora_alpha=32, target_modules=tuple(LORA_TARGETS), use_rslora=False, seed=22, strength=0.5),
    DemoAdapter("scribe", r=4, lora_alpha=8, target_modules=("o_proj", "gate_proj", "up_proj", "down_proj"),
                use_rslora=True, seed=33, strength=0.5),
)


def _adapter_config(spec: DemoAdapter, base_model: Path) -> dict:
    """adapter_config.json as peft's save_pretrained writes it, limited to the keys every peft >= 0.13 knows."""
    return {
        "alpha_pattern": {},
        "auto_mapping": None,
        "base_model_name_or_path": str(base_model),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layer_replication": None,
        "layers_pattern": None,
        "layers_to_transform": None,
        "loftq_config": {},
        "lora_alpha": spec.lora_alpha,
        "lora_dropout": 0.0,
        "megatron_config": None,
        "megatron_core": "megatron.core",
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": spec.r,
        "rank_pattern": {},
        "revision": None,
        "target_modules": list(spec.target_modules),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": spec.use_rslora,
    }


def _adapter_weights(spec: DemoAdapter) -> dict[str, torch.Tensor]:
    """A ~ N(0, 1/in) and B sized so that scaling · B A x has `strength` times the RMS of a unit-RMS x.

    PEFT starts B at zero (a no-op adapter); a demo adapter has to visibly change the output instead.
    """
    gen = torch.Generator().manual_seed(spec.seed)
    b_std = spec.strength / (spec.r**0.5 * spec.scaling)
    weights = {}
    for i in range(LAYERS):
        for module in spec.target_modules:
            key = f"base_model.model.model.layers.{i}.{LORA_TARGETS[module]}"
            fan_in, fan_out = _module_dims(module)
            weights[f"{key}.lora_A.weight"] = torch.randn(spec.r, fan_in, generator=gen) / fan_in**0.5
            weights[f"{key}.lora_B.weight"] = torch.randn(fan_out, spec.r, generator=gen) * b_std
    return weights


def _fill_adapters_dir(out: Path, base_model: Path) -> None:
    for spec in DEMO_ADAPTERS:
        adapter_dir = out / spec.name
        adapter_dir.mkdir()
        _write_json(adapter_dir / "adapter_config.json", _adapter_config(spec, base_model))
        save_file(_adapter_weights(spec), str(adapter_dir / "adapter_model.safetensors"), metadata={"format": "pt"})


def write_demo_adapters(cache_dir: Path | None = None) -> dict[str, Path]:
    """`<cache>/demo-adapters-v1/<name>/` for each demo adapter (PEFT format); writes the base model too."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    base_model = write_demo_checkpoint(root)
    out = _write_atomically(root / ADAPTERS_DIRNAME, lambda tmp: _fill_adapters_dir(tmp, base_model),
                            "demo adapters")
    return {spec.name: out / spec.name for spec in DEMO_ADAPTERS}
