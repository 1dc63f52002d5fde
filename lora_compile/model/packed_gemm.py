"""Which GEMM computes a linear layer: oneDNN on prepacked weights (CPU float32, and bfloat16 where the CPU
computes it natively), else the plain forms.

MKL runs the GEMMs of a decode step (a few rows against a large weight) far below peak; oneDNN with the weight
reordered once into its blocked layout runs the same products 2-3x faster at 6-33 rows and at one row
(python -m benchmarks.gemm). Inductor does this reorder only under `freezing`, which constant-folds every weight
into the graph: adapter slots loaded later would be ignored and each layer would need its own graph. Here the
packed weight is an ordinary (non-persistent) buffer and the product an opaque custom op, so one compiled graph
still serves every layer and adapter slots stay plain tensors.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def plain_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T. For float32 on CPU computed as (weight @ x.T).T: MKL's small-M GEMM streams the weight
    once per row of x, with the weight on the left once (4x faster at 2-3 tokens; python -m benchmarks.gemm).
    In bfloat16 the plain form is the faster one."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.mm(weight, x.t()).t()
    return F.linear(x, weight)


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T, on `packed` (= prepack(weight)) when the layer has one."""
    return plain_linear(x, weight) if packed is None else packed_linear(x, weight, packed)


def native_bf16() -> bool:
    """The CPU computes bfloat16 in hardware (AVX-512 BF16 or AMX), so oneDNN runs bf16 GEMMs natively. Asked of the
    CPU's own flags: oneDNN's check (torch.ops.mkldnn._is_mkldnn_bf16_supported) is true on any AVX-512 CPU, where
    it emulates bf16 (ideep's has_bf16_type_support: ISA >= avx512_core)."""
    return torch.backends.mkldnn.is_available() and (torch.cpu._is_avx512_bf16_supported()
                                                      or torch.cpu._is_amx_tile_supported())


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """float32 always (2-3x MKL at decode sizes); bfloat16 where the CPU computes it natively (packed bf16 runs
    1.5-2x packed float32 per GEMM there: python -m benchmarks.gemm)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and native_bf16())


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """The (out, in) weight in oneDNN's blocked layout: an opaque tensor, only for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


# oneDNN builds (JIT) one kernel per row count and keeps it, ~0.6 MB each per weight shape: rows are padded up to
# a few sizes so that memory stays bounded. They are 4k + 1 because a step has one dummy token: decode steps of
# batch 8, 16, 24, 32 pad nothing, nor does a full prefill step of a budget that is a multiple of 64. Above 129
# the sizes step by 64: at most max_num_batched_tokens / 64 more kernels per shape. Packed beats the faster MKL
# form at prefill sizes too (float32 1.04-1.57x, bfloat16 1.03-1.25x at 65-513 rows; python -m benchmarks.gemm
# --prefill), by more than the padding costs. Two to five rows go to MKL in float32, which is as fast there.
PACKED_ROWS = (1, 9, 13, 17, 21, 25, 29, 33, 41, 49, 57, 65, 81, 97, 113, 129)


def packed_rows(rows: int, dtype: torch.dtype = torch.float32) -> int | None:
    """The row count oneDNN runs for `rows` rows of input, or None where MKL runs them (2-5 rows in float32 only:
    in bf16 oneDNN at 9 rows beats MKL at 2, python -m benchmarks.gemm)."""
    if 2 <= rows <= 5 and dtype == torch.float32:
        return None
    if rows > PACKED_ROWS[-1]:
        return -(-(rows - 1) // 64) * 64 + 1
    return next(b for b in PACKED_ROWS if rows <= b)


# The overload itself: calling the packet resolves the overload on every call (121 calls a step; ~1 us each).
try:
    _LINEAR_POINTWISE = torch.ops.mkldnn._linear_pointwise.default
except (AttributeError, RuntimeError):  # a torch built without oneDNN: `available` is False, nothing packs
    _LINEAR_POINTWISE = None

# Defined with a plain Library rather than @custom_op: the dispatcher then calls the Python kernel directly,
# less per call than through @custom_op's wrapper (121 calls a step; python -m benchmarks.gemm --dispatch).
_LIB = torch.library.Library("lora_compile", "DEF")
_LIB.define("packed_linear(Tensor x, Tensor weight, Tensor packed) -> Tensor")


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    rows = x.shape[0]
    bucket = packed_rows(rows, x.dtype)
    if bucket is None:  # contiguous, as the fake below promises
        return plain_linear(x, weight).contiguous()
    if bucket != rows:
        x = F.pad(x, (0, 0, 0, bucket - rows))
    y = _LINEAR_POINTWISE(x.contiguous(), packed, None, "none", [], "")
    return y if bucket == rows else y[:rows]


# CompositeExplicitAutograd: one kernel for every backend key the opaque packed tensor may carry (MkldnnCPU).
_LIB.impl("packed_linear", _packed_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("lora_compile::packed_linear", lib=_LIB)
def _(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def packed_linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x (tokens, in) @ weight.T, through `packed` (= prepack(weight)) at decode sizes; chosen per call, which a
    compiled graph could not do without a guard per size. An opaque op: Inductor calls it as an extern kernel."""
    return torch.ops.lora_compile.packed_linear(x, weight, packed)
