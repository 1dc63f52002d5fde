"""PEFT LoRA adapters read from disk (adapter_config.json + adapter_model.safetensors), validated.

Only safetensors is read: a pickle file is refused, never opened.

Reading and validating use numpy only, and one `torch.from_numpy` per tensor at the end (no torch op): this runs
on the adapter loader's threads (adapter_loader.py), and a thread that runs parallel torch ops gets an OpenMP team
of its own, which slows every later engine step on few cores (service/runner/engine_thread.py).
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import safetensors
import torch
from safetensors import SafetensorError

from .config import ModelConfig
from .errors import AdapterError, AdapterNameError, AdapterPathError
from .model import LORA_TARGETS, PROJECTIONS, module_shapes

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PARENTS = "|".join(sorted({path.split(".")[0] for path in PROJECTIONS}))  # self_attn, mlp
_KEY = re.compile(rf"(?:^|\.)layers\.(\d+)\.((?:{_PARENTS})\.(\w+))\.lora_([AB])(?:\.[\w-]+)?\.weight$")
_UNSUPPORTED_TARGETS = ("embed_tokens", "lm_head")
MAX_ADAPTER_NAME_CHARS = 255  # a directory name (NAME_MAX on Linux filesystems)
_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


@dataclass
class LoRAAdapter:
    """Host copy of one adapter: weights[layer][peft module] = (A (r, in), B * scaling (out, r))."""

    name: str
    path: Path
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]

    @property
    def nbytes(self) -> int:
        """Host memory its weights take (what the host cache's byte budget counts)."""
        return sum(a.nbytes + b.nbytes for layer in self.weights for a, b in layer.values())


def check_adapter_name(name: str) -> None:
    """Refuse a name that could not be one directory inside an adapter directory, before any file is touched:
    no path separator, no "..", no NUL, no leading dot (hidden files, "." and ".."), not too long."""
    problem = None
    if not name:
        problem = "must not be empty"
    elif len(name) > MAX_ADAPTER_NAME_CHARS:
        problem = f"must be at most {MAX_ADAPTER_NAME_CHARS} characters, got {len(name)}"
    elif "\0" in name:
        problem = "must not contain NUL"
    elif "/" in name or "\\" in name:
        problem = "must not contain a path separator (/ or \\)"
    elif ".." in name:
        problem = 'must not contain ".."'
    elif name.startswith("."):
        problem = "must not start with a dot"
    elif not name.isprintable():
        problem = "must not contain control characters"
    if problem:
        raise AdapterNameError(f"adapter name {name[:64]!r} {problem}")


def resolve_adapter_path(path: str | os.PathLike, roots: tuple[str, ...]) -> Path:
    """The adapter directory, resolved; with `roots`, it must lie inside one of them (symlinks followed)."""
    resolved = Path(path).expanduser().resolve()
    if roots and not any(resolved.is_relative_to(Path(root).expanduser().resolve()) for root in roots):
        raise AdapterPathError(f"adapter path {str(path)!r} is outside the allowed adapter roots")
    return resolved


def _module_name(target: str) -> str:
    return target.rsplit(".", 1)[-1]


def _targets_from_config(raw: dict, source: Path) -> tuple[str, ...]:
    targets = raw.get("target_modules")
    names: set[str]
    if targets is None:
        return ()
    if isinstance(targets, str):
        if targets == "all-linear":
            return tuple(LORA_TARGETS)
        # PEFT treats a string as a regex matched in full against module paths.
        pattern = re.compile(targets)
        paths = {m: (f"model.layers.0.{LORA_TARGETS[m]}", m) for m in LORA_TARGETS}
        paths |= {m: (f"model.{m}", m) for m in _UNSUPPORTED_TARGETS}
        names = {m for m, candidates in paths.items() if any(pattern.fullmatch(c) for c in candidates)}
    else:
        names = {_module_name(t) for t in targets}
    bad = sorted(n for n in names if n not in LORA_TARGETS)
    if bad:
        raise AdapterError(
            f"{source}: target_modules {bad} are not supported; supported: {', '.join(LORA_TARGETS)}"
        )
    return tuple(sorted(names, key=list(LORA_TARGETS).index))


def _check_config(raw: dict, source: Path) -> None:
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{source}: peft_type {raw.get('peft_type')!r} is not supported; only LORA")
    if raw.get("use_dora"):
        raise AdapterError(f"{source}: DoRA adapters (use_dora) are not supported")
    if raw.get("modules_to_save"):
        raise AdapterError(f"{source}: modules_to_save {raw['modules_to_save']} is not supported")
    if raw.get("bias", "none") != "none" or raw.get("lora_bias"):
        raise AdapterError(f"{source}: trained biases (bias={raw.get('bias')!r}) are not supported")
    if raw.get("target_parameters"):
        raise AdapterError(f"{source}: target_parameters is not supported")


@dataclass(frozen=True)
class _ConfigNumbers:
    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]


def _config_numbers(raw: dict, source: str) -> _ConfigNumbers:
    """Every number adapter_config.json sets, checked: Python's json reads NaN, Infinity and 1e309 (inf), and a
    non-finite or zero scaling would turn the adapter's output, and its KV entries, into NaN."""
    def rank(value, field: str) -> int:
        whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())  # NaN, inf: not
        if isinstance(value, bool) or not whole or value < 1:
            raise AdapterError(f"{source}: {field} must be a whole number >= 1, got {value!r}")
        return int(value)

    def alpha(value, field: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value == 0:
            raise AdapterError(f"{source}: {field} must be a finite, non-zero number, got {value!r}")
        return float(value)

    def pattern(field: str, check) -> dict:
        value = raw.get(field) or {}
        if not isinstance(value, dict):
            raise AdapterError(f"{source}: {field} must be a JSON object, got {value!r}")
        return {str(k): check(v, f"{field}[{k!r}]") for k, v in value.items()}

    # PEFT's defaults (LoraConfig: r=8, lora_alpha=8) for a config that leaves them out.
    r = rank(raw.get("r", 8), "r")
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise AdapterError(f"{source}: use_rslora must be true or false, got {use_rslora!r}")
    return _ConfigNumbers(r, alpha(raw.get("lora_alpha", 8), "lora_alpha"), use_rslora,
                          pattern("rank_pattern", rank), pattern("alpha_pattern", alpha))


def _pattern_value(patterns: dict, module_path: str, default: float) -> float:
    # PEFT matches a pattern key against the end of the module's dotted path.
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module_path):
            return value
    return default


def load_adapter(name: str, path: str | os.PathLike, cfg: ModelConfig, max_rank: int,
                 roots: tuple[str, ...] = ()) -> LoRAAdapter:
    directory = resolve_adapter_path(path, roots)
    config_path = directory / CONFIG_FILE
    weights_path = directory / WEIGHTS_FILE
    for file in (config_path, weights_path) if roots else ():  # a file symlinked out of the roots escapes too
        resolve_adapter_path(file, roots)
    if not directory.is_dir():
        raise AdapterError(f"adapter {name!r}: {directory} is not a directory")
    if not config_path.is_file():
        raise AdapterError(f"adapter {name!r}: {config_path} is missing")
    if not weights_path.is_file():
        pickled = [p.name for p in directory.glob("*.bin")] + [p.name for p in directory.glob("*.pt")]
        hint = f" (found {pickled[0]}: pickle files are refused; save with safe_serialization=True)" if pickled else ""
        raise AdapterError(f"adapter {name!r}: {weights_path} is missing{hint}")
    try:
        raw = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"adapter {name!r}: {config_path} is not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise AdapterError(f"adapter {name!r}: {config_path} must hold a JSON object")
    _check_config(raw, config_path)
    _targets_from_config(raw, config_path)
    numbers = _config_numbers(raw, f"adapter {name!r}: {config_path}")
    rank, alpha, use_rslora = numbers.r, numbers.lora_alpha, numbers.use_rslora

    in_out = module_shapes(cfg)
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    try:
        tensors = safetensors.deserialize(weights_path.read_bytes())  # safetensors' own parser; no pickle
    except (SafetensorError, OSError) as e:
        raise AdapterError(f"adapter {name!r}: {weights_path} is not a readable safetensors file ({e})") from e
    for key, spec in tensors:
        m = _KEY.search(key)
        if m is None:
            raise AdapterError(f"adapter {name!r}: {weights_path}: tensor {key!r} is not a supported LoRA weight")
        layer, path, module, which = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if LORA_TARGETS.get(module) != path:
            raise AdapterError(f"adapter {name!r}: {weights_path}: module {module!r} ({key}) is not supported")
        if layer >= cfg.num_hidden_layers:
            raise AdapterError(
                f"adapter {name!r}: {weights_path}: {key} names layer {layer}; the model has {cfg.num_hidden_layers}"
            )
        pairs.setdefault((layer, module), {})[which] = _float32(spec, f"adapter {name!r}: {weights_path}: {key}")

    weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(cfg.num_hidden_layers)]
    max_seen = 0
    for (layer, module), ab in sorted(pairs.items()):
        where = f"adapter {name!r}: layer {layer} {module}"
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{where}: lora_A and lora_B must both be present")
        a, b = ab["A"], ab["B"]
        n_in, n_out = in_out[module]
        r = a.shape[0] if a.ndim else 0
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != n_in or b.shape != (n_out, r):
            raise AdapterError(
                f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base model "
                f"(expected ({r}, {n_in}) / ({n_out}, {r}))"
            )
        if r > max_rank:
            raise AdapterError(f"{where}: rank {r} exceeds max_lora_rank {max_rank}")
        module_path = f"model.layers.{layer}.{module}"
        configured = _pattern_value(numbers.rank_pattern, module_path, rank)
        if r != configured:
            field = "rank_pattern" if configured != rank else "r"
            raise AdapterError(f"{where}: the tensors have rank {r} but adapter_config.json {field} says {configured}")
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise AdapterError(f"{where}: weights contain NaN or infinity")
        module_alpha = _pattern_value(numbers.alpha_pattern, module_path, alpha)
        with np.errstate(over="ignore"):
            scaled_b = b * np.float32(module_alpha / (math.sqrt(r) if use_rslora else r))
        if not np.isfinite(scaled_b).all():  # finite B and alpha can still overflow once scaled
            raise AdapterError(f"{where}: lora_B scaled by lora_alpha {module_alpha:g} / rank overflows to infinity")
        weights[layer][module] = (torch.from_numpy(np.ascontiguousarray(a)),
                                  torch.from_numpy(np.ascontiguousarray(scaled_b)))
        max_seen = max(max_seen, r)
    if not pairs:
        raise AdapterError(f"adapter {name!r}: {weights_path} holds no LoRA weights")
    targets = tuple(m for m in LORA_TARGETS if any(m in layer for layer in weights))
    return LoRAAdapter(name, directory, max_seen, alpha, use_rslora, targets, weights)


def _float32(spec: dict, where: str) -> np.ndarray:
    """One safetensors tensor as a float32 array, converted in numpy (bfloat16: its bits are float32's top half)."""
    dtype, shape, data = spec["dtype"], tuple(spec["shape"]), spec["data"]
    if dtype == "BF16":
        bits = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    if dtype not in _FLOAT_DTYPES:
        raise AdapterError(f"{where}: dtype {dtype} is not supported; LoRA weights must be F32, F16, BF16 or F64")
    array = np.frombuffer(data, dtype=np.dtype(_FLOAT_DTYPES[dtype]).newbyteorder("<")).reshape(shape)
    return array.astype(np.float32)  # a copy: the file's bytes are not kept
