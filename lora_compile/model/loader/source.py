"""Where a served model comes from: a Hugging Face directory (config.json, safetensors, tokenizer.json) or one
GGUF file (llama.cpp's format: config, tokenizer and chat template in its metadata, weights dequantised at load).

Both give the engine the same four things: the typed config, a directory holding tokenizer.json and
tokenizer_config.json (the chat template), a readable name, and a checkpoint to copy weights from. A GGUF file's
tokenizer files are derived once into the cache directory, keyed by the file's identity (path, size, mtime)."""
from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ...config import ModelConfig, cache_root
from ...errors import CheckpointError
from .checkpoint import SafetensorsCheckpoint
from .gguf_checkpoint import GGUFCheckpoint, is_gguf
from .gguf_tokenizer import build_tokenizer, tokenizer_config

DERIVED_VERSION = "1"  # bump when the derived files change


@dataclass
class ModelSource:
    config: ModelConfig
    tokenizer_dir: Path       # tokenizer.json (+ tokenizer_config.json, generation_config.json)
    name: str                 # the default served model name
    open_checkpoint: Callable[[], object]  # a context manager with get(name, shape)

    @classmethod
    def resolve(cls, model: str | Path, tokenizer: str | Path | None = None) -> "ModelSource":
        """`model`: a directory or a .gguf file; `tokenizer`: a directory whose tokenizer files are used instead."""
        path = Path(model)
        if is_gguf(path):
            ckpt = GGUFCheckpoint(path)
            config = ModelConfig.from_dict(ckpt.config_dict(), source=str(path))
            tokenizer_dir = Path(tokenizer) if tokenizer else _derived_dir(path, ckpt)
            name = path.name[:-len(".gguf")] if path.name.endswith(".gguf") else path.name
            return cls(config, tokenizer_dir, name, lambda: ckpt)
        if path.is_file():
            raise CheckpointError(f"{path}: not a model directory or a GGUF file (no GGUF magic)")
        return cls(ModelConfig.from_dir(path), Path(tokenizer) if tokenizer else path, path.name,
                   lambda: SafetensorsCheckpoint(path))


def _derived_dir(path: Path, ckpt: GGUFCheckpoint) -> Path:
    """tokenizer.json, tokenizer_config.json and config.json of a GGUF file, written once (atomically)."""
    stat = path.resolve().stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{DERIVED_VERSION}".encode())
    final = cache_root() / "gguf" / f"{path.stem}-{key.hexdigest()[:16]}"
    if (final / "tokenizer.json").is_file():
        return final
    meta = ckpt.metadata()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".derive-", dir=final.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(ckpt.config_dict(), indent=2))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(meta), indent=2))
        build_tokenizer(meta, str(path)).save(str(tmp / "tokenizer.json"))  # last: its presence marks completion
        try:
            tmp.rename(final)
        except OSError:  # another process derived it first: identical content
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
