"""Which form each projection's base weight takes (the one place that decides it), the start log's lines saying
so, and loading a checkpoint tensor in its form."""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from . import amx_int8
from .gguf_blocks import EXACT_INT4_TYPES, EXACT_INT8_TYPES
from .tensor import GGUF_GROUP, GROUP_SIZES, INT4_OFFSET, QuantizedTensor, quantize_int4, quantize_int8

Quantization = Literal["auto", "none", "gguf", "int8", "int4"]
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)


@dataclass(frozen=True)
class WeightForm:
    """A projection's base weight form (the quantization package docstring): kind "none", "int4" or "int8"."""

    kind: str = "none"
    group_size: int = 0


NONE = WeightForm()


def form_key(forms: dict[str, WeightForm]) -> int:
    """A small number that differs between layers whose projections' forms differ (0: all full width)."""
    held = sorted((path, f.kind, f.group_size) for path, f in forms.items() if f.kind != "none")
    return zlib.crc32(repr(held).encode()) if held else 0


def plan(requested: str, group_size: int, ckpt, projections: dict[str, tuple[str, ...]],
         names: dict[str, list[str]], in_features: dict[str, int], device: torch.device,
         dtype: torch.dtype) -> tuple[list[dict[str, WeightForm]], list[str]]:
    """Each layer's form for each projection path (projections: path -> its modules; names: module -> its
    checkpoint tensor in every layer; in_features: path -> K), and the start log's lines saying what each tensor
    type got. "gguf": a projection whose modules are all int4 types is kept as stored, one with Q8_0 or Q5 blocks
    among them as int8 groups, the rest is dequantised. "auto": "gguf" for a GGUF file in bfloat16 or float16,
    else "none". "int4" / "int8": every projection, a GGUF's blocks as they are where they are that form, the rest
    quantized at load. "none": every weight at full width."""
    if requested not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {requested!r}")
    types = getattr(ckpt, "tensor_type", None)
    if requested == "gguf" and types is None:
        raise ValueError("quantization gguf keeps a GGUF file's blocks: the model is not a GGUF file (use int8 or "
                         "int4 to quantize a float checkpoint at load)")
    requested = _resolved(requested, types is not None, dtype)
    notes = []
    if requested == "none" and types is not None and dtype == torch.float32:
        notes.append(f"{dtype}: dequantised (torch's weight-only kernels run float32 several times slower than "
                     "its float32 GEMM; --dtype bfloat16 or --quantization gguf keep the file's blocks)")
    if requested == "int4" and group_size not in GROUP_SIZES:
        raise ValueError(f"quantization_group_size must be one of {GROUP_SIZES}, got {group_size}")
    if requested == "int4" and device.type == "cuda" and dtype != torch.bfloat16:
        raise ValueError("int4 weights on CUDA need bfloat16 activations (--dtype bfloat16): torch's CUDA int4 "
                         "kernel computes in bfloat16 only")
    layers = len(next(iter(names.values())))
    forms: list[dict[str, WeightForm]] = [{} for _ in range(layers)]
    by_type: dict[str, set[str]] = {}
    for i in range(layers):
        for path, modules in projections.items():
            tensor_types = {types(names[m][i]) if types else None for m in modules}
            form = _form(requested, group_size, tensor_types)
            if form.kind == "int4" and in_features[path] % form.group_size:
                form = NONE  # (the input size does not divide into groups: at full width)
            if form.group_size and device.type == "cuda" and dtype != torch.bfloat16:
                form = NONE  # (gguf on CUDA in another dtype: torch's int4 kernel is bfloat16 only)
            forms[i][path] = form
            for tensor_type in tensor_types:
                by_type.setdefault(tensor_type or "float", set()).add(_describe(form, tensor_type))
    lines = [f"{tensor_type}: {', '.join(sorted(described))}" for tensor_type, described in sorted(by_type.items())]
    return forms, lines + notes


def _resolved(requested: str, is_gguf: bool, dtype: torch.dtype) -> str:
    """"auto" made definite: "gguf" for a GGUF file in bfloat16 or float16, else "none" (in float32 no weight-only
    kernel of torch's is as fast as its float32 GEMM, and a float checkpoint stays as it is)."""
    if requested != "auto":
        return requested
    return "gguf" if is_gguf and dtype in (torch.bfloat16, torch.float16) else "none"


def table_form(requested: str, ckpt, name: str, what: str, shape: tuple[int, int], device: torch.device,
               dtype: torch.dtype, compiled: bool = False) -> tuple[WeightForm, list[str]]:
    """The form of the embeddings ("model.embed_tokens.weight") or the LM head ("lm_head.weight"; tied: the
    embeddings' tensor) of `shape` (vocabulary, hidden), and its start-log line (naming it `what`): a GGUF file's
    blocks as stored where the projections' are kept
    ("gguf", or "auto" in bfloat16/float16) and their type is one (Q4_0/Q4_1/Q4_K as int4, Q8_0/Q5 as int8 groups
    of 32), else full width. At 8B shapes each is 1 GB of bfloat16, the head read by every step. A float
    checkpoint's untied head with `int8`: int8 a scale a row where Inductor's AMX template runs it (`compiled`: in
    a frame of its own, core/compiled_stack.compile_head), else full width (torch's int8 kernel takes 4 rows a pass
    over the whole vocabulary)."""
    types = getattr(ckpt, "tensor_type", None)
    if types is None and what == "head" and requested == "int8" and compiled and amx_int8.usable(*shape, dtype,
                                                                                                 device):
        form = WeightForm("int8", 0)
        return form, [f"{what}: {_describe(form, None)}"]
    hidden_size = shape[1]
    if types is None or _resolved(requested, True, dtype) not in ("gguf", "int8", "int4"):
        return NONE, []
    if hidden_size % GGUF_GROUP or dtype == torch.float32 or (device.type == "cuda" and dtype != torch.bfloat16):
        return NONE, []  # (float32: torch's weight-only kernels are slower than the GEMM there; kernels.linear)
    tensor_type = types(name)
    if tensor_type in EXACT_INT4_TYPES:
        form = WeightForm("int4", GGUF_GROUP)
    elif tensor_type in EXACT_INT8_TYPES:
        form = WeightForm("int8", GGUF_GROUP)
    else:
        return NONE, []
    return form, [f"{what} {tensor_type}: {_describe(form, tensor_type)}"]


def _form(requested: str, group_size: int, tensor_types: set[str | None]) -> WeightForm:
    """One projection's form in one layer, from its modules' tensor types there (None: a float checkpoint)."""
    if requested in ("none", "auto"):  # (auto on a float checkpoint: as it is)
        return NONE
    if requested == "int8":  # (a GGUF's 4-, 5- and 8-bit blocks as int8 groups, exactly; the rest per row)
        exact = tensor_types <= {*EXACT_INT4_TYPES, *EXACT_INT8_TYPES}
        return WeightForm("int8", GGUF_GROUP if exact else 0)
    if requested == "int4":
        return WeightForm("int4", group_size)
    if tensor_types <= set(EXACT_INT4_TYPES):  # gguf
        return WeightForm("int4", GGUF_GROUP)
    if tensor_types <= {*EXACT_INT4_TYPES, *EXACT_INT8_TYPES}:
        return WeightForm("int8", GGUF_GROUP)  # (an int4 code is an int8 group's code too: w = (q - 8) s + z)
    return NONE


def _describe(form: WeightForm, tensor_type: str | None) -> str:
    if form.kind == "none":
        return "dequantised" if tensor_type not in (None, "F32", "F16", "BF16") else "full width"
    if form.group_size == GGUF_GROUP and tensor_type in (*EXACT_INT4_TYPES, *EXACT_INT8_TYPES):
        return f"{form.kind} groups of 32, as stored"
    return f"{form.kind}{f' groups of {form.group_size}' if form.group_size else ' per row'}, quantized at load"


def load(ckpt, name: str, shape: tuple[int, int], form: WeightForm) -> QuantizedTensor:
    """The checkpoint tensor `name` in `form`: a GGUF's blocks as stored where they are that form (an int4 type in
    an int8 group form is widened, exactly), else the float weight quantized."""
    tensor_type = getattr(ckpt, "tensor_type", lambda _: None)(name)
    if form.group_size == GGUF_GROUP and tensor_type in (*EXACT_INT4_TYPES, *EXACT_INT8_TYPES):
        qt = ckpt.get_quantized(name, shape)
        if qt.kind == form.kind:
            return qt
        if form.kind == "int8":  # int4 as int8 groups: w = (q - 8) s + z = q' s + z, q' = q - 8
            return QuantizedTensor("int8", (qt.codes.to(torch.int16) - INT4_OFFSET).to(torch.int8), qt.scale,
                                   qt.zero, qt.group_size)
    weight = ckpt.get(name, shape)
    if form.kind == "int4":
        return quantize_int4(weight, form.group_size)
    if form.group_size:
        raise ValueError(f"{name}: int8 in groups comes only from a GGUF's blocks, not a {tensor_type} tensor")
    return quantize_int8(weight)
