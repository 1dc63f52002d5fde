"""PEFT LoRA adapters read from disk (adapter_config.json + adapter_model.safetensors), validated.

Only safetensors is read: a pickle file is refused, never opened.

Reading and validating use numpy only, and one `torch.from_numpy` per tensor at the end (no torch op): this runs
on the adapter loader's threads (loader.py), and a thread that runs parallel torch ops gets an OpenMP team
of its own, which slows every later engine step on few cores (service/runner/engine_thread.py).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import re2
import safetensors
import torch
from safetensors import SafetensorError

from ..config import ModelConfig
from ..errors import AdapterError, AdapterNameError, AdapterPathError
from ..model.causal_lm import PROJECTIONS, lora_targets, module_shapes
from .adapter_config import check_config, config_numbers, invocation_tokens, read_config, targets_from_config

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PARENTS = "|".join(sorted({path.split(".")[0] for path in PROJECTIONS}))  # self_attn, mlp (every family's)
# Tensor names come from the file: matched by RE2 (linear time; \w is ASCII there), at most this long.
# lora_A / lora_B (…weight), and DoRA's magnitude (lora_magnitude_vector, as PEFT saves it: no adapter name or
# .weight; with them as its in-memory state dict names it).
_KEY = re2.compile(rf"(?:^|\.)layers\.(\d+)\.((?:{_PARENTS})\.(\w+))\."
                   r"(?:lora_([AB])(?:\.[\w-]+)?\.weight|lora_(magnitude)_vector(?:\.[\w-]+\.weight)?)$")
MAX_TENSOR_NAME_CHARS = 1024
MAX_HEADER_BYTES = 1 << 20  # the safetensors header (JSON): ~100 bytes per tensor
MAX_ADAPTER_NAME_CHARS = 128
_ADAPTER_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_ADAPTER_NAME_CHARS - 1}}}", re.ASCII)
log = logging.getLogger(__name__)
_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}
NEVER_ACTIVE = 1 << 62  # an activated adapter's start in a prompt without its invocation tokens


@dataclass
class LoRAAdapter:
    """Host copy of one adapter: weights[layer][peft module] = (A (r, in), B * scaling (out, r)); a DoRA adapter's
    magnitudes[layer][peft module] = m (out,), the norm each output row of W + B·A is rescaled to."""

    name: str
    path: Path
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    # SHA-256 of the weights as served (B scaled): what the prefix cache keys this adapter's KV by, with its name.
    digest: bytes = b""
    magnitudes: list[dict[str, torch.Tensor]] | None = None  # DoRA (use_dora) only
    # Activated LoRA (alora_invocation_tokens): the adapter acts from the last occurrence of these in a prompt on.
    invocation_tokens: tuple[int, ...] | None = None

    @property
    def use_dora(self) -> bool:
        return self.magnitudes is not None

    @property
    def nbytes(self) -> int:
        """Host memory its weights take (what the host cache's byte budget counts)."""
        return (sum(a.nbytes + b.nbytes for layer in self.weights for a, b in layer.values())
                + sum(m.nbytes for layer in self.magnitudes or () for m in layer.values()))


def check_adapter_name(name: str) -> None:
    """The one rule for an adapter's name, wherever it comes from (--adapter, LoadAdapter and the HTTP load
    endpoint, a request naming one, an adapter directory's entry): 1 to 128 ASCII letters, digits, '.', '_' or '-',
    starting with a letter or digit. So a name is a plain directory entry (no separator, no "." or "..", not
    hidden), not an option ("-x"), and safe to print (no control characters, no bidirectional marks). Checked
    before any file is touched."""
    if not _ADAPTER_NAME.fullmatch(name):
        raise AdapterNameError(f"adapter name {name[:64]!r} is not allowed: use 1 to {MAX_ADAPTER_NAME_CHARS} letters, "
                               "digits, '.', '_' or '-', starting with a letter or digit")


def activation_start(prompt_ids: list[int], invocation: tuple[int, ...] | None) -> int:
    """The first position an adapter acts on in a sequence with this prompt: 0 for a plain adapter; for an activated
    one (PEFT's calculate_alora_offsets) the start of the last occurrence of its invocation tokens, or, where the
    prompt has none, never (NEVER_ACTIVE): the base model answers, as in PEFT."""
    if invocation is None:
        return 0
    n, first = len(invocation), invocation[0]
    for start in range(len(prompt_ids) - n, -1, -1):
        if prompt_ids[start] == first and tuple(prompt_ids[start:start + n]) == invocation:
            return start
    return NEVER_ACTIVE


def resolve_adapter_path(path: str | os.PathLike, roots: tuple[str, ...]) -> Path:
    """The adapter directory, resolved; with `roots`, it must lie inside one of them (symlinks followed)."""
    resolved = Path(path).expanduser().resolve()
    if roots and not any(resolved.is_relative_to(Path(root).expanduser().resolve()) for root in roots):
        raise AdapterPathError(f"adapter path {str(path)!r} is outside the allowed adapter roots")
    return resolved


def load_adapter(name: str, path: str | os.PathLike, cfg: ModelConfig, max_rank: int,
                 roots: tuple[str, ...] = (), dora: bool = True) -> LoRAAdapter:
    """Read and validate one adapter directory. Every way its files can be wrong, unreadable ones included, is an
    AdapterError saying what (the server remembers it until the files change). dora=False: DoRA adapters are
    refused (a quantized base has no full-width weight to take each row's norm of)."""
    try:
        return _load_adapter(name, path, cfg, max_rank, roots, dora)
    except (AdapterError, MemoryError):
        raise
    except OSError as e:  # e.g. a name too long for the filesystem, no permission, a file gone meanwhile
        raise AdapterError(f"adapter {name!r}: cannot read {e.filename or path}: {e.strerror or e}") from e
    except Exception as e:  # noqa: BLE001 - a check this module lacks: still this adapter's failure, logged
        log.warning("adapter %r: unexpected error while reading %s", name, path, exc_info=True)
        raise AdapterError(f"adapter {name!r}: {path} cannot be read ({type(e).__name__}: {e})") from e


def _load_adapter(name: str, path: str | os.PathLike, cfg: ModelConfig, max_rank: int,
                  roots: tuple[str, ...], dora: bool) -> LoRAAdapter:
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
    where = f"adapter {name!r}: {config_path}"
    raw = read_config(config_path, f"adapter {name!r}")
    check_config(raw, where)
    targets_from_config(raw, where, lora_targets(cfg))
    numbers = config_numbers(raw, where)
    rank, alpha, use_rslora = numbers.r, numbers.lora_alpha, numbers.use_rslora
    use_dora = raw.get("use_dora") is True
    invocation = invocation_tokens(raw, where, cfg.vocab_size)
    if use_dora and not dora:
        raise AdapterError(f"{where}: DoRA adapters (use_dora) need the base model's full-width weights; this server "
                           "keeps them quantized (serve with --quantization none for DoRA)")

    in_out = module_shapes(cfg)
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    names = _read_header(weights_path, f"adapter {name!r}: {weights_path}", cfg, max_rank)
    try:
        tensors = safetensors.deserialize(names.data)  # safetensors' own parser; no pickle
    except SafetensorError as e:
        raise AdapterError(f"adapter {name!r}: {weights_path} is not a readable safetensors file ({e})") from e
    for key, spec in tensors:
        layer, module, which = names.parsed[key]
        pairs.setdefault((layer, module), {})[which] = _float32(spec)

    weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(cfg.num_hidden_layers)]
    magnitudes: list[dict[str, torch.Tensor]] = [{} for _ in range(cfg.num_hidden_layers)]
    max_seen = 0
    for (layer, module), ab in sorted(pairs.items()):
        where = f"adapter {name!r}: layer {layer} {module}"
        if set(ab) - {"M"} != {"A", "B"}:
            raise AdapterError(f"{where}: lora_A and lora_B must both be present")
        if ("M" in ab) != use_dora:  # a magnitude changes what the layer computes: never dropped, never made up
            raise AdapterError(f"{where}: lora_magnitude_vector is {'missing' if use_dora else 'present'} but "
                               f"adapter_config.json use_dora is {'true' if use_dora else 'not true'}")
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
        configured = numbers.rank_pattern.get(module_path, rank)
        if r != configured:
            field = "rank_pattern" if configured != rank else "r"
            raise AdapterError(f"{where}: the tensors have rank {r} but adapter_config.json {field} says {configured}")
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise AdapterError(f"{where}: weights contain NaN or infinity")
        module_alpha = numbers.alpha_pattern.get(module_path, alpha)
        with np.errstate(over="ignore"):
            scaled_b = b * np.float32(module_alpha / (math.sqrt(r) if use_rslora else r))
        if not np.isfinite(scaled_b).all():  # finite B and alpha can still overflow once scaled
            raise AdapterError(f"{where}: lora_B scaled by lora_alpha {module_alpha:g} / rank overflows to infinity")
        if use_dora:
            magnitude = ab["M"]
            if magnitude.shape != (n_out,) or not np.isfinite(magnitude).all():
                raise AdapterError(f"{where}: lora_magnitude_vector {tuple(magnitude.shape)} must be {n_out} finite "
                                   "values (one per output)")
            magnitudes[layer][module] = torch.from_numpy(np.ascontiguousarray(magnitude))
        weights[layer][module] = (torch.from_numpy(np.ascontiguousarray(a)),
                                  torch.from_numpy(np.ascontiguousarray(scaled_b)))
        max_seen = max(max_seen, r)
    if not pairs:
        raise AdapterError(f"adapter {name!r}: {weights_path} holds no LoRA weights")
    targets = tuple(m for m in lora_targets(cfg) if any(m in layer for layer in weights))
    kept = magnitudes if use_dora else None
    return LoRAAdapter(name, directory, max_seen, alpha, use_rslora, targets, weights,
                       _digest(weights, kept, invocation), kept, invocation)


def _digest(weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]],
            magnitudes: list[dict[str, torch.Tensor]] | None, invocation: tuple[int, ...] | None) -> bytes:
    h = hashlib.sha256()
    if invocation is not None:  # where it acts is part of what it computes
        h.update(b"alora" + np.asarray(invocation, dtype=np.int64).tobytes())
    for i, layer in enumerate(weights):
        for module in sorted(layer):
            a, b = layer[module]
            h.update(f"{i}.{module}:{tuple(a.shape)}{tuple(b.shape)}".encode())
            h.update(a.numpy().tobytes())
            h.update(b.numpy().tobytes())
            if magnitudes is not None:
                h.update(b"magnitude" + magnitudes[i][module].numpy().tobytes())
    return h.digest()


@dataclass(frozen=True)
class _Header:
    data: bytes                                  # the whole file
    parsed: dict[str, tuple[int, str, str]]      # tensor name: (layer, module, "A", "B" or "M" (DoRA's magnitude))


def _read_header(path: Path, where: str, cfg: ModelConfig, max_rank: int) -> _Header:
    """The weights file, read only when no larger than the largest adapter of this model could be, and its header
    checked before safetensors parses it: the count of tensors, their names and dtypes (shapes: see the caller)."""
    in_out = module_shapes(cfg)
    targets = lora_targets(cfg)
    layers = cfg.num_hidden_layers
    max_tensors = 3 * layers * len(targets)  # lora_A, lora_B and (DoRA) a magnitude per module
    limit = 8 + MAX_HEADER_BYTES + 8 * layers * sum((max_rank + 1) * n_out + max_rank * n_in
                                                    for n_in, n_out in in_out.values())
    size = path.stat().st_size
    with path.open("rb") as f:
        data = f.read(limit + 1) if size <= limit else b""
    if size > limit or len(data) > limit:  # (the file may have grown since stat)
        raise AdapterError(f"{where} is {max(size, len(data))} bytes; an adapter of this model with rank at most "
                           f"{max_rank} (max_lora_rank) takes at most {limit} bytes")
    unreadable = f"{where} is not a readable safetensors file"
    if len(data) < 8:
        raise AdapterError(f"{unreadable} ({len(data)} bytes: no header)")
    n = int.from_bytes(data[:8], "little")
    if 8 + n > len(data):  # (garbage, or cut short)
        raise AdapterError(f"{unreadable} (its header length says {n} bytes; the file has {len(data) - 8} after it)")
    if n > MAX_HEADER_BYTES:
        raise AdapterError(f"{where}: its header is {n} bytes; at most {MAX_HEADER_BYTES}")
    try:
        header = json.loads(data[8:8 + n])
    except RecursionError:
        raise AdapterError(f"{unreadable} (its header nests too deeply)") from None
    except ValueError as e:  # not JSON, not UTF-8
        raise AdapterError(f"{unreadable} (its header is not JSON: {e})") from e
    if not isinstance(header, dict):
        raise AdapterError(f"{unreadable} (its header is not a JSON object)")
    header.pop("__metadata__", None)
    if len(header) > max_tensors:
        raise AdapterError(f"{where} holds {len(header)} tensors; a LoRA adapter of this model holds at most "
                           f"{max_tensors} (lora_A, lora_B and a DoRA magnitude of {len(targets)} modules in "
                           f"{layers} layers)")
    parsed: dict[str, tuple[int, str, str]] = {}
    seen: set[tuple[int, str, str]] = set()
    for key, spec in header.items():
        shown = key if len(key) <= MAX_TENSOR_NAME_CHARS else key[:64] + "..."
        m = _KEY.search(key) if len(key) <= MAX_TENSOR_NAME_CHARS else None
        if m is None:
            raise AdapterError(f"{where}: tensor {shown!r} is not a supported LoRA weight")
        layer, path_in_layer, module = int(m.group(1)), m.group(2), m.group(3)
        which = m.group(4) or "M"  # (M: DoRA's magnitude)
        if targets.get(module) != path_in_layer:
            raise AdapterError(f"{where}: module {module!r} ({key}) is not supported")
        if layer >= layers:
            raise AdapterError(f"{where}: {key} names layer {layer}; the model has {layers}")
        if (layer, module, which) in seen:
            tensor = {"A": "lora_A", "B": "lora_B", "M": "lora_magnitude_vector"}[which]
            raise AdapterError(f"{where}: {key} is a second {tensor} of layer {layer} {module}")
        seen.add((layer, module, which))
        dtype = spec.get("dtype") if isinstance(spec, dict) else None
        if dtype != "BF16" and dtype not in _FLOAT_DTYPES:
            raise AdapterError(f"{where}: {key}: dtype {dtype} is not supported; LoRA weights must be F32, F16, BF16 "
                               "or F64")
        parsed[key] = (layer, module, which)
    return _Header(data, parsed)


def _float32(spec: dict) -> np.ndarray:
    """One safetensors tensor (its dtype checked by _read_header) as a float32 array, converted in numpy (bfloat16:
    its bits are float32's top half)."""
    dtype, shape, data = spec["dtype"], tuple(spec["shape"]), spec["data"]
    if dtype == "BF16":
        bits = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    array = np.frombuffer(data, dtype=np.dtype(_FLOAT_DTYPES[dtype]).newbyteorder("<")).reshape(shape)
    return array.astype(np.float32)  # a copy: the file's bytes are not kept
