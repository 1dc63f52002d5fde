"""int4 products of many rows on CPUs with AMX: Inductor's own AMX micro-kernel for weight-only int4 GEMMs.

torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`) goes 4 rows of x at a time, dequantising the whole weight
for each 4: right for decode, linear in the rows above that. Inductor has a C++ GEMM template for the same product
whose AMX micro-kernel dequantises a weight tile once for up to 32 rows (`CppWoqInt4GemmTemplate`, picked under
max-autotune for *frozen* weights only). Here it is lowered for the model's weights as they are (graph inputs,
one copy, torch's int4pack layout): the step re-blocks the codes into the layout the micro-kernel reads (one
Inductor pass over the int4 bytes, ~2.5 ms for a 14336 x 4096 weight) and runs the template on them.

Measured on a Xeon with AMX, 2 threads, 14336 x 4096 int4 groups of 32, bf16, weights streamed from memory, ms a
product (torch's kernel / re-block + template): 8 rows 6.1 / 6.9, 16 rows 11.2 / 6.8, 32 rows 22.2 / 7.4, 64 rows
43.7 / 9.3; 512 rows: dequantised in the graph + oneDNN 132 / 44. Hence kernels.linear takes it above
TILES_MIN_TOKENS. Nothing here is hand-written C++: the kernel is Inductor's, the re-blocking torch ops.
"""
from __future__ import annotations

import torch

from .tensor import INT4_OFFSET

# Above this many tokens a step's int4 products take the tiles (kernels.linear); at or below, torch's kernel.
TILES_MIN_TOKENS = 12
TILE_GROUP_SIZES = (32, 64, 128)  # the micro-kernel's (Inductor's check_woq_int4_extra)
_LOW = 0x0F0F0F0F  # the low nibble of each byte of an int32 word


_available: list[bool] = []  # available()'s answer, once asked (kernels.pack asks, before any tracing)


def available() -> bool:
    """Whether Inductor writes AMX code on this CPU (its vector ISA, which ATEN_CPU_CAPABILITY may lower); the
    first call also registers the template's lowering (_register_lowering)."""
    if not _available:
        _available.append(_amx_isa())
        if _available[0]:
            _register_lowering()
    return _available[0]


def _amx_isa() -> bool:
    try:
        from torch._inductor.codegen import cpp_gemm_template
        from torch._inductor.cpu_vec_isa import VecAMX, pick_vec_isa
    except ImportError:  # (another torch: the template or its names moved)
        return False
    return hasattr(cpp_gemm_template, "CppWoqInt4GemmTemplate") and isinstance(pick_vec_isa(), VecAMX)


def usable(codes: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype) -> bool:
    """Whether a CPU int4pack weight (kernels.pack) can take the tiles: bfloat16 activations, a group size the
    micro-kernel takes (the input width is a whole number of groups), whole 64-row blocks, and an AMX CPU."""
    return (dtype == torch.bfloat16 and group_size in TILE_GROUP_SIZES and scales.shape[1] % 64 == 0
            and codes.device.type == "cpu" and available())


def tile_layout(codes: torch.Tensor) -> torch.Tensor:
    """torch's CPU int4pack (N, K/2) uint8 (blocks of 64 rows; for each k 32 bytes, byte i: row i in the low
    nibble, row i + 32 in the high) re-blocked as the AMX micro-kernel reads it (blocks of 32 rows; for each k 16
    bytes, byte j: row j low, row j + 16 high). Bitwise ops on int32 words, which Inductor vectorises."""
    n, half = codes.shape
    words = codes.view(n // 64, 2 * half, 32).view(torch.int32)  # (N/64, K, 8): bytes 0-15, then 16-31
    # The two halves by index, not by slicing: in the compiled step this runs inside a torch.cond branch, where
    # functionalization turns slices into slice_copy ops that Inductor ran as copies (aten::copy_, 11 ms of a
    # 32-token demo step); an index with a constant range is a load inside the one fused pass.
    j = torch.arange(4, device=codes.device)
    a, c = words[..., j], words[..., j + 4]
    first = (a & _LOW) | ((c & _LOW) << 4)           # rows 0-15 low, 16-31 high: the first 32-row block
    second = ((a >> 4) & _LOW) | (c & ~_LOW)         # rows 32-47 low, 48-63 high: the second
    return torch.stack([first, second], 1).view(torch.uint8).reshape(n, half)


def dequantize_tiles(codes: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The (N, K) weight a tile_layout weight stands for (w = (q - 8) * scale + zero): the op's eager form."""
    n, k = scales.shape[1], scales.shape[0] * group_size
    blocks = codes.reshape(n // 32, k, 16)
    q = torch.cat([blocks & 0x0F, blocks >> 4], dim=2).permute(0, 2, 1).reshape(n, k // group_size, group_size)
    scale, zero = scales[..., 0].t().unsqueeze(-1), scales[..., 1].t().unsqueeze(-1)
    return ((q.to(dtype) - INT4_OFFSET) * scale + zero).reshape(n, k)


@torch.library.custom_op("lora_serve::int4_mm_tiles", mutates_args=())
def int4_mm_tiles(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group: torch.Tensor,
                  group_size: int, padding_rows: int = 0) -> torch.Tensor:
    """x @ w.T for a tile_layout weight, zeros in x's last `padding_rows` rows (the step's dummy token, never
    read); compiled, Inductor's AMX template over the other rows (_lower). `group`: the group size as a tensor,
    which the template reads through a pointer (a graph input here: a tensor constant in a repeated region's
    subgraph is what broke Inductor's own int4 lowering, kernels.weight_only_mm_cpu)."""
    y = torch.nn.functional.linear(x, dequantize_tiles(codes, scales, group_size, x.dtype))
    if padding_rows:
        y[y.shape[0] - padding_rows:] = 0
    return y


@int4_mm_tiles.register_fake
def _(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group: torch.Tensor,
      group_size: int, padding_rows: int = 0) -> torch.Tensor:
    return x.new_empty(x.shape[0], scales.shape[1])


def _register_lowering() -> None:
    """Lower int4_mm_tiles to Inductor's CppWoqInt4GemmTemplate (its AMX micro-kernel: dynamic row counts take it)
    where the template applies, else to the op's eager form."""
    from torch._inductor.codegen.cpp_gemm_template import CppWoqInt4GemmTemplate
    from torch._inductor.kernel.mm_common import mm_args
    from torch._inductor.lowering import constant_pad_nd, fallback_handler, register_lowering, slice_
    from torch._inductor.select_algorithm import autotune_select_algorithm
    from torch._inductor.utils import has_free_symbols

    op = torch.ops.lora_serve.int4_mm_tiles.default
    fallback = fallback_handler(op, add_to_fallback_set=False)

    @register_lowering(op, type_promotion_kind=None)
    def _lower(x, codes, scales, group, group_size, padding_rows=0):
        # Only a dynamic row count is sure to get the AMX micro-kernel, the one that reads tile_layout (a few
        # static rows get the AVX-512 one, which reads torch's int4pack layout).
        rows = x.get_size()[0]
        if not has_free_symbols((rows,)):
            return fallback(x, codes, scales, group, group_size, padding_rows)
        # The real rows only, zeros after them: a 33rd row (the dummy token) took a 14336 x 4096 product from
        # 8.1-8.5 to 9.0-9.6 ms, a 3072 x 576 one from 0.27 to 0.29-0.30 (a tail past the micro-kernel's rows).
        real = slice_(x, 0, 0, rows - padding_rows, clamp=False) if padding_rows else x
        _, _, _, layout, mat1, mat2 = mm_args(real, codes, layout=None, use_4x2_dim=True, mat2_transposed=True)
        choices: list = []
        CppWoqInt4GemmTemplate[group_size].add_choices(choices, layout, [mat1, mat2, group, scales])
        if len(choices) != 1:  # (the template declined these shapes: the eager form, correct and slower)
            return fallback(x, codes, scales, group, group_size, padding_rows)
        node, _ = autotune_select_algorithm("lora_serve_int4_mm_tiles", choices, [mat1, mat2, group, scales],
                                            layout)
        return constant_pad_nd(node, [0, 0, 0, padding_rows]) if padding_rows else node

