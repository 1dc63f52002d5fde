"""int8 weights with a scale a row on CPUs with AMX: Inductor's AMX micro-kernel for weight-only int8 GEMMs, at
every row count, over the codes held once in the layout it reads.

torch's CPU int8 kernel (`_weight_int8pack_mm`) is fast for one row and linear in the rows above that (a 14336 x
4096 weight in bf16, 2 threads: 2.8 ms at 1 row, 6.8 at 8, 25 at 32), so `--quantization int8` decoded a batch
slower than bfloat16. Inductor's C++ GEMM template has an AMX micro-kernel for bf16 x int8 that converts a weight
tile to bf16 once for up to 32 rows and applies the row scales as its epilogue; Inductor picks it under max-autotune
for frozen weights only. Here it is lowered for the model's weights as graph inputs, held in the template's own
blocked layout (pack), so nothing is re-blocked in the step. Measured on a Xeon with AMX, 2 threads, bf16, 12
distinct weights streamed from memory, ms a product (template / torch's int8 kernel / the bf16 weight's GEMM):
14336 x 4096 at 1, 8 and 32 rows 4.1 / 2.9 / 5.3, 3.9 / 6.9 / 5.4, 4.6 / 26 / 6.2; 16384 x 2048 at 8 and 32 rows
2.4 / 7.3 / 3.8, 2.8 / 22 / 4.1; 2048 x 8192 1.1 / 1.9 / 1.6, 1.4 / 6.6 / 1.9; at 512 rows 36 against bf16's 41 and
13 against 11. So one layout serves every step; torch's faster single row is the one thing given up.

Nothing here is hand-written C++: the kernel is Inductor's, the layout torch ops.
"""
from __future__ import annotations

from unittest import mock

import torch

from . import amx_tiles

BLOCK_N = 32  # output rows a block of the layout holds: the micro-kernel's (its register blocking 32 x 32 x 32)
_VNNI = 2  # consecutive k a bf16 AMX tile row pairs (VNNI-2)

# The L1 size the template's run-time cache blocking is told. It sizes a K block of the weight by its int8 bytes,
# yet the micro-kernel keeps that block dequantised to bf16 in L1, twice the bytes (Inductor's static blocking
# allows for this; its dynamic one, which a step of any row count takes, does not): with the CPU's own 48 KiB, 2048
# x 8192 at 32 rows took 1.86 ms, told 32 KiB 1.84, 8 KiB 1.36; 14336 x 4096 at 8 rows 5.1, 3.9, 3.9 (Xeon AMX).
_L1_BYTES = 8192


def usable(n: int, k: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether an (n, k) int8 weight with a scale a row takes the template: bfloat16 activations on a CPU whose
    Inductor writes AMX code, whole blocks of BLOCK_N rows and an even k (pairs of k per tile row)."""
    return (dtype == torch.bfloat16 and device.type == "cpu" and n % BLOCK_N == 0 and k % _VNNI == 0
            and amx_tiles.available() and _register_lowering())


def tile_layout(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 codes as the micro-kernel reads them: blocks of BLOCK_N rows, each (K / 2, BLOCK_N, 2), i.e.
    element (n, k) at [n // 32, k // 2, n % 32, k % 2]; returned as (N / 32, K, 32), Inductor's blocked shape."""
    n, k = codes.shape
    blocked = codes.view(n // BLOCK_N, BLOCK_N, k // _VNNI, _VNNI).permute(0, 2, 1, 3)
    return blocked.contiguous().view(n // BLOCK_N, k, BLOCK_N)


def codes_of(tiles: torch.Tensor) -> torch.Tensor:
    """The (N, K) codes a tile_layout weight holds."""
    blocks, k, _ = tiles.shape
    return tiles.view(blocks, k // _VNNI, BLOCK_N, _VNNI).permute(0, 2, 1, 3).reshape(blocks * BLOCK_N, k)


@torch.library.custom_op("lora_serve::int8_mm_tiles", mutates_args=())
def int8_mm_tiles(x: torch.Tensor, tiles: torch.Tensor, scale: torch.Tensor, padding_rows: int) -> torch.Tensor:
    """x @ (q * scale).T for a tile_layout weight, zeros in x's last `padding_rows` rows (the step's dummy token,
    never read); compiled, Inductor's AMX template over the other rows (_register_lowering). Eager (an engine not
    compiled), the weight's codes widened for one GEMM: the template rounds x @ q.T to the activation dtype, then
    scales it, as this does."""
    y = torch.nn.functional.linear(x, codes_of(tiles).to(x.dtype)) * scale
    if padding_rows:
        y[y.shape[0] - padding_rows:] = 0
    return y


@int8_mm_tiles.register_fake
def _(x: torch.Tensor, tiles: torch.Tensor, scale: torch.Tensor, padding_rows: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], tiles.shape[0] * tiles.shape[2])


_registered: list[bool] = []


def _register_lowering() -> bool:
    """Lower int8_mm_tiles to Inductor's C++ GEMM template with its AMX micro-kernel, reading the weight as already
    blocked (once: usable asks, at load, outside any compiled region). False where this torch lacks the names."""
    if _registered:
        return _registered[0]
    try:
        from torch._inductor import ir
        from torch._inductor import lowering as L
        from torch._inductor.codegen import cpp_gemm_template
        from torch._inductor.codegen.cpp_micro_gemm import CppMicroGemmAMX
        from torch._inductor.codegen.cpp_utils import create_epilogue_with_attr
        from torch._inductor.kernel.mm_common import mm_args
        from torch._inductor.select_algorithm import autotune_select_algorithm, realize_inputs
        from torch._inductor.utils import has_free_symbols
    except ImportError:
        _registered.append(False)
        return False

    class PreBlockedTemplate(cpp_gemm_template.CppGemmTemplate):
        """The template over a weight held in its blocked, VNNI-2 layout: its blocking and packing of a graph
        input (a copy of the weight in every step) become views."""

        @classmethod
        def block_weight(cls, W, new_size, padding):
            return L.view(W, new_size)  # (tile_layout's bytes, contiguous: no copy)

        @classmethod
        def pack_vnni_weight(cls, W, micro_gemm, new_size):
            return ir.ExternKernel.require_contiguous(ir.ExternKernel.realize_input(W))

        def get_options(self, *args, **kwargs):
            options = super().get_options(*args, **kwargs)
            options["L1_cache_size"] = _L1_BYTES
            return options

    create_micro_gemm = cpp_gemm_template.create_micro_gemm

    def micro_gemm_for_32_rows(name, m, *args, **kwargs):
        # A step's row count is dynamic and the micro-kernel is picked by its hint: 48 would pick the 48 x 16 one,
        # whose blocks of 16 rows are not tile_layout's. Picked as for 32 rows, it is always 32 x 32 x 32.
        return create_micro_gemm(name, BLOCK_N, *args, **kwargs)

    op = torch.ops.lora_serve.int8_mm_tiles.default
    fallback = L.fallback_handler(op, add_to_fallback_set=False)

    @L.register_lowering(op, type_promotion_kind=None)
    def _lower(x, tiles, scale, padding_rows):
        # A static row count would be compiled for its own micro-kernel (a few rows: an AVX-512 one, which reads
        # another layout): only a dynamic one takes the template.
        rows = x.get_size()[0]
        if not has_free_symbols((rows,)):
            return fallback(x, tiles, scale, padding_rows)
        # The template over the real rows only, zeros after them: the step's dummy token as a 33rd row took a 16384
        # x 2048 product from 2.8 to 3.6 ms (a 17th from 2.4 to 3.1: a tail past a 16-row AMX tile).
        real = L.slice_(x, 0, 0, rows - padding_rows, clamp=False) if padding_rows else x
        blocks, k, block_n = tiles.get_size()
        weight = L.view(tiles, [k, blocks * block_n])  # (the shape the template reads: K x N, as a view)
        _, _, _, layout, mat1, mat2 = mm_args(real, weight, layout=None)

        def scaled(buf):
            return create_epilogue_with_attr(buf, "mul", other=realize_inputs(L.expand(scale, layout.size)))

        choices: list = []
        with mock.patch.object(cpp_gemm_template, "create_micro_gemm", micro_gemm_for_32_rows):
            template = PreBlockedTemplate.add_choices(choices, layout, [mat1, mat2, scale], epilogue_creator=scaled)
        blocking = getattr(template, "register_blocking", None)
        if len(choices) != 1 or getattr(template, "name", "") != CppMicroGemmAMX.__name__ or blocking is None \
                or blocking.block_n != BLOCK_N:
            return fallback(x, tiles, scale, padding_rows)  # (declined, or another micro-kernel: correct, slower)
        node, _ = autotune_select_algorithm("lora_serve_int8_mm_tiles", choices, [mat1, mat2, scale], layout)
        return L.constant_pad_nd(node, [0, 0, 0, padding_rows]) if padding_rows else node

    _registered.append(True)
    return True

