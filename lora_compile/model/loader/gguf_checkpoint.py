"""llama.cpp's GGUF files, read with `gguf` (llama.cpp's own Python reader): the config from the file's metadata,
and weights under the Hugging Face names the engine asks for, one tensor at a time: dequantised at load (get), or,
for a projection kept in its 4-bit form (lora_compile/model/quantization/), as the file's own codes and scales (get_quantized).

The file is memory-mapped; a tensor is dequantised (numpy, float32) only when the model copies it into place, so
loading holds one dequantised tensor at a time beside the engine's weights.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ...errors import CheckpointError

GGUF_MAGIC = b"GGUF"
# Tensor types dequantised at load (the gguf package's own dequantisers). Others are refused by name at open.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# general.architecture -> the Hugging Face architecture served for it. llama.cpp's converter interleaves the
# rotary halves of Q and K for "llama" (undone here, as transformers does); the others store them as HF does.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_PERMUTED_QK = {"llama"}
# {arch}.<key> -> config.json key
_CONFIG_KEYS = {
    "block_count": "num_hidden_layers", "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps", "rope.freq_base": "rope_theta",
    "attention.key_length": "head_dim", "attention.sliding_window": "sliding_window", "vocab_size": "vocab_size",
}


def is_gguf(path: str | Path) -> bool:
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def _gguf():
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise CheckpointError("reading a GGUF file needs the 'gguf' package: pip install gguf") from e
    return gguf


class GGUFCheckpoint:
    """One GGUF file: metadata(), config_dict() and get(name, shape), like SafetensorsCheckpoint's."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._open_reader = self._open_tensors = None
        self._meta: dict | None = None
        self.arch = str(self.value("general.architecture"))
        if self.arch not in ARCHITECTURES:
            raise CheckpointError(
                f"{self.path}: GGUF architecture {self.arch!r} is not served; GGUF files of: {', '.join(ARCHITECTURES)}")
        unsupported = sorted({t.tensor_type.name for t in self._reader.tensors} - set(SUPPORTED_TYPES))
        if unsupported:
            raise CheckpointError(f"{self.path}: tensor type {', '.join(unsupported)} is not supported; "
                                  f"supported: {', '.join(SUPPORTED_TYPES)}")
        n_layers = int(self.value(f"{self.arch}.block_count"))
        self._names = _gguf().get_tensor_name_map(getattr(_gguf().MODEL_ARCH, self.arch.upper()), n_layers)

    @property
    def _reader(self):
        """The file's reader, opened on first use (again after a `with` block closed it)."""
        if self._open_reader is None:
            try:
                self._open_reader = _gguf().GGUFReader(str(self.path))
            except (ValueError, OSError, KeyError) as e:
                raise CheckpointError(f"{self.path}: not a readable GGUF file ({e})") from e
        return self._open_reader

    @property
    def _tensors(self) -> dict:
        if self._open_tensors is None:
            self._open_tensors = {t.name: t for t in self._reader.tensors}
        return self._open_tensors

    def __enter__(self) -> "GGUFCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        # Loading touched every page of the file's memory map: unmapped here, not kept resident beside the copies
        # made from it (a 4.5 GB file's pages otherwise count in the server's memory for its lifetime).
        self._open_reader = self._open_tensors = None

    def value(self, key: str, default=None):
        """One key-value field (read alone: a start whose tokenizer is already derived reads no vocabulary)."""
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def metadata(self) -> dict:
        """Every key-value field; arrays as lists (the tokenizer's vocabulary and merges included)."""
        if self._meta is None:
            self._meta = {key: field.contents() for key, field in self._reader.fields.items()
                          if not key.startswith("GGUF.")}
        return self._meta

    def config_dict(self) -> dict:
        """The model's config.json, as transformers would write it for this file."""
        arch, fields = self.arch, self._reader.fields
        config: dict = {"architectures": [ARCHITECTURES[arch]], "torch_dtype": "float32"}
        for key, name in _CONFIG_KEYS.items():
            if f"{arch}.{key}" in fields:
                config[name] = self.value(f"{arch}.{key}")
        tokens = fields.get("tokenizer.ggml.tokens")
        config.setdefault("vocab_size", len(tokens.data) if tokens is not None else 0)
        scaling = self.value(f"{arch}.rope.scaling.type")
        if scaling not in (None, "none"):
            config["rope_scaling"] = {"rope_type": scaling, "factor": self.value(f"{arch}.rope.scaling.factor", 1.0),
                                      "original_max_position_embeddings":
                                          self.value(f"{arch}.rope.scaling.original_context_length", 8192)}
        config["tie_word_embeddings"] = "output.weight" not in self._tensors
        for key in ("bos_token_id", "eos_token_id"):
            if f"tokenizer.ggml.{key}" in fields:
                config[key] = self.value(f"tokenizer.ggml.{key}")
        if arch == "qwen2":
            config["use_sliding_window"] = False  # llama.cpp writes no window for Qwen2; transformers' default
        return config

    def _gguf_name(self, name: str) -> str | None:
        base, _, suffix = name.rpartition(".")
        mapped = self._names.get_name(base)
        return f"{mapped}.{suffix}" if mapped is not None else None

    def tensor_type(self, name: str) -> str | None:
        """The GGUF type of the tensor the Hugging Face checkpoint would call `name` ("Q4_1", "F32", ...), or None
        where the file has none."""
        gguf_name = self._gguf_name(name)
        tensor = self._tensors.get(gguf_name) if gguf_name else None
        return None if tensor is None else tensor.tensor_type.name

    def get_quantized(self, name: str, shape: tuple[int, int]):
        """`name`'s tensor as int4 groups of 32 exactly as stored (quantization.from_gguf_blocks; Q4_0, Q4_1 and Q4_K
        only), rows in Hugging Face's order."""
        from ..quantization import from_gguf_blocks

        gguf_name = self._gguf_name(name)
        tensor = self._tensors[gguf_name]
        file_shape = tuple(int(d) for d in reversed(tensor.shape))
        if file_shape != tuple(shape):
            raise CheckpointError(f"{self.path}: tensor {gguf_name!r} ({name!r}) has shape {file_shape}, the config "
                                  f"implies {tuple(shape)}")
        qt = from_gguf_blocks(tensor.data, tensor.tensor_type.name, file_shape)
        heads = self._permuted_heads(gguf_name)
        if heads is not None:
            order = torch.from_numpy(_unpermute(np.arange(shape[0]), heads))
            qt = qt.rows(order)
        return qt

    def _permuted_heads(self, gguf_name: str) -> int | None:
        """The heads whose rows llama.cpp interleaved in this tensor (Q, K of "llama"), or None."""
        if self.arch not in _PERMUTED_QK or not gguf_name.endswith((".attn_q.weight", ".attn_k.weight",
                                                                     ".attn_q.bias", ".attn_k.bias")):
            return None
        heads = self.value(f"{self.arch}.attention.head_count")
        if ".attn_k." in gguf_name:
            heads = self.value(f"{self.arch}.attention.head_count_kv", heads)
        return int(heads)

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor the Hugging Face checkpoint would call `name`, dequantised to float32 and checked against the
        expected shape; errors name the file and both names."""
        gguf_name = self._gguf_name(name)
        tensor = self._tensors.get(gguf_name) if gguf_name else None
        if tensor is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} (GGUF {gguf_name!r}) is missing from the file")
        weights = np.asarray(_gguf().dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        weights = weights.reshape(tuple(int(d) for d in reversed(tensor.shape)))  # GGUF lists dims innermost first
        heads = self._permuted_heads(gguf_name)
        if heads is not None:
            weights = _unpermute(weights, heads)
        if tuple(weights.shape) != tuple(shape):
            raise CheckpointError(f"{self.path}: tensor {gguf_name!r} ({name!r}) has shape {tuple(weights.shape)}, "
                                  f"the config implies {tuple(shape)}")
        if not weights.flags.writeable:  # F32 tensors come back as the read-only memory map itself
            weights = weights.copy()
        return torch.from_numpy(np.ascontiguousarray(weights))


def _unpermute(weights: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf permute of Q/K rows: per head it stores the rotary pairs interleaved
    (row 2i, 2i+1 = HF rows i, i + head_dim/2)."""
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)
