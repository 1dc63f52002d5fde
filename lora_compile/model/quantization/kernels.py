"""Packing a quantized weight for the device's kernel, and the product with it: torch's own weight-only kernels
(CPU int4pack / int8pack, CUDA int4pack), Inductor's AMX templates on CPUs with AMX (amx_tiles for int4 above a
few rows, amx_int8 for int8 a scale a row at every row count) or, for many tokens elsewhere on the CPU, the weight
dequantised in the graph."""
from __future__ import annotations

import torch

from . import amx_int8, amx_tiles
from .tensor import INT4_OFFSET, QuantizedTensor


def pack(qt: QuantizedTensor, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, scales) in the layout the device's kernel reads: int4 (torch's int4pack, scales and zeros
    (K / group, N, 2) in the activation dtype); int8 per row (the codes (N, K), or on a CPU with AMX in bfloat16
    the AMX template's blocks (amx_int8), and one scale a row in that dtype); int8 in groups as two int4 halves of
    one int4pack (_int4_halves)."""
    if qt.kind == "int8" and not qt.group_size:
        scale = qt.scale.to(device=device, dtype=dtype)
        if amx_int8.usable(*qt.shape, dtype, device):
            return amx_int8.tile_layout(qt.codes.to(device)), scale
        return qt.codes.to(device).contiguous(), scale
    if qt.kind == "int8":
        qt = _int4_halves(qt)
    scales_and_zeros = torch.stack([qt.scale.t(), qt.zero.t()], dim=-1).to(device=device, dtype=dtype).contiguous()
    codes = qt.codes.to(torch.int32)
    if device.type == "cuda":  # two codes a byte, the even column in the high nibble (torch >= 2.5's input)
        packed = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8).to(device)
        return torch.ops.aten._convert_weight_to_int4pack(packed.contiguous(), 8), scales_and_zeros
    cpu_int4_layout_known(), amx_tiles.available()  # (asked here, outside any compiled region: linear reads them)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1), scales_and_zeros


def _int4_halves(qt: QuantizedTensor) -> QuantizedTensor:
    """An int8-group weight as the int4 weight of twice its rows whose two halves sum to it, exactly: a code
    q = 16 h + l (h = q >> 4 in [-8, 7], l = q & 15), so w = q s + z = (h + 8 - 8) 16 s + ((l - 8) s + 8 s + z).
    torch has no int8 kernel with a scale per group; its int4 kernel computes both halves in one call."""
    q = qt.codes.to(torch.int16)
    high, low = (q >> 4) + INT4_OFFSET, q & 0x0F
    codes = torch.cat([high, low]).to(torch.uint8)
    scale = torch.cat([16 * qt.scale, qt.scale])
    zero = torch.cat([torch.zeros_like(qt.zero), qt.zero + INT4_OFFSET * qt.scale])
    return QuantizedTensor("int4", codes, scale, zero, qt.group_size)


# Where the AMX template does not apply (amx_tiles.usable): up to this many tokens a step runs torch's weight-only
# kernel; above it, the weight dequantised in the graph and oneDNN's GEMM. The kernel's cost grows with the rows (4
# at a time: 27 us at 1 token for 1536 x 576 in bf16 against a dense GEMM's 97, 2.8 ms at 256 against 0.32), while
# dequantising costs about what ~50 rows do (~0.5 ms there, Inductor's fused pass): SmolLM2's bf16 steps crossed
# over between 32 tokens (kernel 89 ms, dequantised 126) and 250 (566 against 313) on a Xeon with AMX, 2 threads.
KERNEL_MAX_TOKENS = 64


def linear(x: torch.Tensor, kind: str, codes: torch.Tensor, scales: torch.Tensor, group_size: int,
           padding_rows: int = 0, group: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, K) @ w.T for a packed weight (pack). int8 a scale a row on a CPU with AMX in bfloat16: Inductor's AMX
    template (amx_int8), whatever the rows. Else on the CPU in bfloat16: torch's weight-only
    kernel for a few tokens; for more, compiled on a CPU with AMX, Inductor's AMX template over the int4 codes
    (amx_tiles: `group`, the group size as a tensor, is what it reads), else the dequantised weight's GEMM; in float32 always the
    dequantised GEMM, where torch's kernels took 10x a dense GEMM (a scalar path). `padding_rows`: x's last rows
    are padding, whose outputs are never read; the CPU kernel leaves them out (zeros there): it goes 4 rows at a
    time, so batch 8's ninth row, the step's dummy token, cost a third pass over the weight (8.7 against 6.1 ms
    for 14336 x 4096 int4 bf16 on a Xeon with AMX)."""
    x = x.contiguous()  # (torch's weight-only kernels read their input densely)
    if codes.dim() == 3:  # int8 in the AMX template's blocks (pack): the template at every row count
        return amx_int8.int8_mm_tiles(x, codes, scales, padding_rows)
    if x.device.type == "cuda":
        if kind == "int8" and not group_size:  # (no int8 weight-only kernel of torch's there: into the GEMM)
            return torch.nn.functional.linear(x, codes.to(x.dtype)) * scales
        return _halves_summed(kind, group_size, torch.ops.aten._weight_int4pack_mm(x, codes, group_size, scales))

    # (the branches of one torch.cond take the same operands: `group` is the tiles' alone)
    def kernel(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *group: torch.Tensor) -> torch.Tensor:
        return kernel_linear(x, kind, codes, scales, group_size, padding_rows)

    def dense(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *group: torch.Tensor) -> torch.Tensor:
        if kind == "int8" and not group_size:
            return torch.nn.functional.linear(x, codes.to(x.dtype)) * scales
        w = _dequantize_cpu_int4(codes, scales, group_size, x.dtype)
        if kind == "int8":
            high, low = w.chunk(2, dim=0)
            w = high + low
        return torch.nn.functional.linear(x, w)

    def tiles(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
        return tiles_linear(x, kind, codes, scales, group_size, group, padding_rows)

    int4pack = kind != "int8" or group_size
    if int4pack and (not cpu_int4_layout_known() or scales.shape[1] % _CPU_INT4_BLOCK):
        return kernel(x, codes, scales)
    if x.dtype == torch.float32:
        return dense(x, codes, scales)
    if not torch.compiler.is_compiling():
        return (dense if x.shape[0] > KERNEL_MAX_TOKENS else kernel)(x, codes, scales)
    # decided at run time, in the one graph
    if int4pack and group is not None and amx_tiles.usable(codes, scales, group_size, x.dtype):
        return torch.cond(x.shape[0] > amx_tiles.TILES_MIN_TOKENS, tiles, kernel, (x, codes, scales, group))
    return torch.cond(x.shape[0] > KERNEL_MAX_TOKENS, dense, kernel, (x, codes, scales))


def tiles_linear(x: torch.Tensor, kind: str, codes: torch.Tensor, scales: torch.Tensor, group_size: int,
                 group: torch.Tensor, padding_rows: int = 0) -> torch.Tensor:
    """x @ w.T through Inductor's AMX template (amx_tiles), compiled only: the codes re-blocked in the graph, x's
    last `padding_rows` rows left out (zeros there)."""
    return _halves_summed(kind, group_size, amx_tiles.int4_mm_tiles(x, amx_tiles.tile_layout(codes), scales, group,
                                                                     group_size, padding_rows))


def kernel_linear(x: torch.Tensor, kind: str, codes: torch.Tensor, scales: torch.Tensor,
                  group_size: int, padding_rows: int = 0) -> torch.Tensor:
    """x @ w.T by torch's weight-only kernel alone, however many rows x has (the LM head: a row per sampled token,
    where dequantising a 100k-row head for a few rows would cost more than it saves; where an AMX template applies,
    the head takes it in a compiled frame instead: CausalLM.head_tiles_product); padding rows as linear. int8 a
    scale a row held in the AMX template's blocks (pack) has no other kernel: linear's."""
    x = x.contiguous()
    if x.device.type == "cuda" or codes.dim() == 3:
        return linear(x, kind, codes, scales, group_size, padding_rows)
    return _halves_summed(kind, group_size, weight_only_mm_cpu(x, codes, scales, group_size, padding_rows))


def _halves_summed(kind: str, group_size: int, y: torch.Tensor) -> torch.Tensor:
    """An int8-group weight's product is over its two int4 halves (_int4_halves): their outputs summed. An int8
    weight with a scale a row (group_size 0) is one product."""
    if kind == "int8" and group_size:
        high, low = y.chunk(2, dim=-1)
        return high + low
    return y


# torch's CPU int4 layout (_convert_weight_to_int4pack_for_cpu), where N divides into blocks of 64 rows: for each
# block and each input index k, 32 bytes, byte i holding row i's code (low nibble) and row i + 32's (high).
_CPU_INT4_BLOCK = 64


def _dequantize_cpu_int4(codes: torch.Tensor, scales: torch.Tensor, group_size: int,
                         dtype: torch.dtype) -> torch.Tensor:
    """The (N, K) weight in `dtype` that a CPU int4 pack (pack) stands for: w = (q - 8) * scale + zero."""
    n, k = scales.shape[1], scales.shape[0] * group_size
    blocks = codes.reshape(n // _CPU_INT4_BLOCK, 1, k, _CPU_INT4_BLOCK // 2)
    # Both nibbles by one broadcast shift (rows 0-31 of a block low, 32-63 high), not a cat of the two halves:
    # compiled, the weight is then one pass from the codes, where the cat kept two uint8 copies of the weight's
    # size beside it (an 8B's prefill step left 0.77 GB of freed temporaries in the allocator, now 0.37 GB).
    shift = torch.arange(0, 8, 4, dtype=torch.uint8, device=codes.device).view(1, 2, 1, 1)
    q = ((blocks >> shift) & 0x0F).permute(0, 1, 3, 2).reshape(n, k // group_size, group_size)
    scale, zero = scales[..., 0].t().unsqueeze(-1), scales[..., 1].t().unsqueeze(-1)
    return ((q.to(dtype) - INT4_OFFSET) * scale + zero).reshape(n, k)


_layout_checked: list[bool] = []  # cpu_int4_layout_known's answer, once asked (pack asks, before any tracing)


def cpu_int4_layout_known() -> bool:
    """Whether this torch packs int4 as _dequantize_cpu_int4 reads it (a private layout: checked once)."""
    if _layout_checked:
        return _layout_checked[0]
    codes = torch.randint(0, 16, (2 * _CPU_INT4_BLOCK, 64), generator=torch.Generator().manual_seed(0),
                          dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    ones = torch.stack([torch.ones(2, 128), torch.full((2, 128), float(INT4_OFFSET))], dim=-1)
    _layout_checked.append(bool(torch.equal(_dequantize_cpu_int4(packed, ones, 32, torch.float32), codes.float())))
    return _layout_checked[0]


# Defined with a plain Library, as packed_gemm's op, not @custom_op: the dispatcher then calls the Python kernel
# directly, where @custom_op's wrapper cost ~30 us a call (profiled), 120 calls a step: a batch-1 demo step ran
# 65.1 / 73.5 tok/s through it against 76.2 / 76.5 so (Xeon AMX, bf16, alternating runs). Overloads resolved once.
_LIB = torch.library.Library("lora_serve", "FRAGMENT")
_LIB.define("weight_only_mm_cpu(Tensor x, Tensor codes, Tensor scales, int group_size, int padding_rows) -> Tensor")
_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default
_INT8_MM = torch.ops.aten._weight_int8pack_mm.default


def _weight_only_mm_cpu(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group_size: int,
                        padding_rows: int) -> torch.Tensor:
    rows = x[:x.shape[0] - padding_rows] if padding_rows else x
    y = _INT4_MM(rows, codes, group_size, scales) if group_size else _INT8_MM(rows, codes, scales)
    return torch.nn.functional.pad(y, (0, 0, 0, padding_rows)) if padding_rows else y


_LIB.impl("weight_only_mm_cpu", _weight_only_mm_cpu, "CPU")
_WEIGHT_ONLY_MM = torch.ops.lora_serve.weight_only_mm_cpu.default


@torch.library.register_fake("lora_serve::weight_only_mm_cpu", lib=_LIB)
def _(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group_size: int,
      padding_rows: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], scales.shape[1] if group_size else codes.shape[0])


def weight_only_mm_cpu(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group_size: int,
                       padding_rows: int) -> torch.Tensor:
    """torch's CPU weight-only kernel (int4 in groups, or int8 a scale a row where group_size is 0) as an opaque
    call in the compiled graph, over all but x's last `padding_rows` rows (zeros there). Opaque, because Inductor's
    own lowering of the int4 kernel passes the group size as a tensor constant, which torch 2.13 hands wrongly to a
    repeated region's subgraph ("group size must be a scalar": the decoder layer is one), and because a slice of
    the step's rows traced there would guard on its size being 1 (a batch of one: a recompile)."""
    return _WEIGHT_ONLY_MM(x, codes, scales, group_size, padding_rows)


def nbytes(codes: torch.Tensor, scales: torch.Tensor) -> int:
    return codes.numel() * codes.element_size() + scales.numel() * scales.element_size()
