"""Hugging Face checkpoints: config.json + model.safetensors (or a sharded index), read lazily.

Tensors are read one at a time from the memory-mapped files and copied straight into the model's
parameters, so loading never holds a second full copy of the weights.
"""
from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ...errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsCheckpoint:
    """Name → file map over one or many safetensors files, opened lazily."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._weight_map = self._read_weight_map()
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}

    def _read_weight_map(self) -> dict[str, Path]:
        index = self.model_dir / INDEX_FILE
        single = self.model_dir / SINGLE_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a safetensors index (needs a 'weight_map'): {e}") from e
            return {name: self.model_dir / fname for name, fname in weight_map.items()}
        if single.is_file():
            with self._open_file(single) as f:
                return {name: single for name in f.keys()}
        if any(self.model_dir.glob("*.bin")) or any(self.model_dir.glob("*.pt")):
            raise CheckpointError(f"{self.model_dir}: only pickle (.bin/.pt) weights found; convert them to safetensors")
        raise CheckpointError(f"{self.model_dir}: no {SINGLE_FILE} or {INDEX_FILE}")

    @staticmethod
    def _open_file(path: Path):
        if not path.is_file():
            raise CheckpointError(f"{path}: missing weights file")
        try:
            return safe_open(str(path), framework="pt", device="cpu")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e

    def __enter__(self) -> "SafetensorsCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._handles.clear()

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor `name`, checked against the expected shape; errors name the file and tensor."""
        path = self._weight_map.get(name)
        if path is None:
            raise CheckpointError(f"{self.model_dir}: tensor {name!r} is missing from the checkpoint")
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = self._stack.enter_context(self._open_file(path))
        try:
            tensor = handle.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: tensor {name!r} cannot be read ({e})") from e
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, the config implies {tuple(shape)}"
            )
        return tensor
