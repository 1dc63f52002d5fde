"""Float32 products on oneDNN rather than MKL, for attention's products (compile_policy.prefill_attention_onednn
decides where: a CPU on which oneDNN keeps them float32).

torch's CPU BLAS, and its matmul, hand a float32 product to oneDNN only under `fp32_precision = "bf16"`; otherwise
MKL's sgemm runs it, which on an AMD EPYC with AVX-512 ran at 106 GFLOP/s where oneDNN's float32 brgemm ran 391
(docs/benchmarks.md, "Prefill"). Each op here sets that for its own call only (~1 us to set and restore), never
for the model's GEMMs. Opaque ops: the compiled graph calls them as it called the aten ops they wrap (extern
kernels either way). Defined with a plain Library, as packed_gemm's op (a Python kernel the dispatcher calls
directly); a FRAGMENT: packed_gemm defines the namespace."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

_LIB = torch.library.Library("lora_compile", "FRAGMENT")
_LIB.define("sdpa_onednn(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor")
_LIB.define("matmul_onednn(Tensor a, Tensor b) -> Tensor")
_MATMUL = torch.backends.mkldnn.matmul


@contextlib.contextmanager
def _on_onednn():
    previous = _MATMUL.fp32_precision
    _MATMUL.fp32_precision = "bf16"
    try:
        yield
    finally:
        _MATMUL.fp32_precision = previous


def _sdpa_onednn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                 scale: float) -> torch.Tensor:
    with _on_onednn():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _matmul_onednn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    with _on_onednn():
        return torch.matmul(a, b)


_LIB.impl("sdpa_onednn", _sdpa_onednn, "CPU")
_LIB.impl("matmul_onednn", _matmul_onednn, "CPU")


@torch.library.register_fake("lora_compile::sdpa_onednn", lib=_LIB)
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    return q.new_empty(*q.shape[:-1], v.shape[-1])


@torch.library.register_fake("lora_compile::matmul_onednn", lib=_LIB)
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.empty(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]),
                       dtype=a.dtype, device=a.device)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """torch's fused attention (the CPU flash kernel) over float32 q, k, v, its products on oneDNN."""
    return torch.ops.lora_compile.sdpa_onednn(q, k, v, mask, scale)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.matmul of float32 (..., M, K) and (..., K, N) on oneDNN."""
    return torch.ops.lora_compile.matmul_onednn(a, b)
