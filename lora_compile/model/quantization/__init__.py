"""Quantized base weights: the forms a projection's weight may take, decided here, and their kernels.

A projection (LoRALinear) holds its base weight in one form, one copy in memory:
- "none": full width (float32 / bfloat16), as loaded (and oneDNN-packed on the CPU: packed_gemm);
- "int4": 4-bit codes in groups along the input dimension, each group with a scale and a zero: w = (q - 8) * scale
  + zero, torch's own weight-only kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int4pack_mm` on CUDA), and
  for steps of many tokens on a CPU with AMX Inductor's AMX template for the same product (amx_tiles);
- "int8": 8-bit codes, with one scale per output row (group_size 0: w = q * scale, `_weight_int8pack_mm` on the
  CPU; on a CPU with AMX in bfloat16 Inductor's AMX template at every row count, the codes held in its blocked
  layout: amx_int8), or a scale and a zero per group of 32 (a GGUF's 5- and 8-bit blocks: w = q * scale + zero,
  below).
LoRA's A and B stay in the activation dtype on top. The activations stay in their dtype: these are weight-only.

Where a weight comes from decides whether its form loses anything:
- a GGUF file's Q4_0, Q4_1 and Q4_K blocks are int4 groups of 32 exactly (Q4_0: scale d, zero 0; Q4_1: d and
  m + 8d; Q4_K: each 32-weight sub-block's d·sc and 8·d·sc − dmin·m), so with `gguf` (`auto` in bfloat16) they
  are kept as they are;
  Q8_0, Q5_0 and Q5_1 blocks are int8 groups of 32 exactly (w = q s + z), which torch's int8 kernel (one scale a
  row) cannot hold: they run as two int4 halves of one int4 product (_int4_halves), exactly; the types no kernel
  here holds without loss (Q6_K's 16-weight sub-blocks, the K types below 4 bits and Q5_K) are dequantised;
- a float checkpoint is quantized at load when asked (`int8`: per row, symmetric; `int4`: groups of
  --quantization-group-size, min-max), which loses what 8 or 4 bits lose (tests/test_quantization.py bounds it).
A fused projection (qkv, gate_up) has one form in a layer, the one all its modules' types allow; layers may differ
(a Q4_K_M file's Q6_K layers): the CPU's step is one graph over all layers, and the per-layer frames (CUDA before
torch 2.12) compile once per form at warm-up.
"""
from . import amx_int8, amx_tiles
from .embedding import QuantizedEmbedding
from .gguf_blocks import EXACT_INT4_TYPES, EXACT_INT8_TYPES, from_gguf_blocks
from .kernels import KERNEL_MAX_TOKENS, cpu_int4_layout_known, kernel_linear, linear, nbytes, pack, tiles_linear
from .plan import NONE, QUANTIZATIONS, Quantization, WeightForm, form_key, load, plan, table_form
from .tensor import GGUF_GROUP, GROUP_SIZES, QuantizedTensor, cat_rows, quantize_int4, quantize_int8

__all__ = ["amx_int8", "amx_tiles", "EXACT_INT4_TYPES", "EXACT_INT8_TYPES", "GGUF_GROUP", "GROUP_SIZES", "KERNEL_MAX_TOKENS", "NONE",
           "QUANTIZATIONS", "Quantization", "QuantizedTensor", "WeightForm", "cat_rows", "cpu_int4_layout_known", "kernel_linear",
           "form_key", "from_gguf_blocks", "linear", "load", "nbytes", "pack", "plan", "quantize_int4",
           "quantize_int8", "table_form", "tiles_linear", "QuantizedEmbedding"]
