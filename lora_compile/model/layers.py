"""Building blocks of the decoder: RMSNorm, rotary embedding tables and the multi-LoRA linear layer."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from . import lora_deltas, quantization
from .forward_batch import DUMMY_TOKENS, LoRABatch
from .packed_gemm import linear, prepack


class RMSNorm(nn.Module):
    """`offset` (Model family.norm_offset): 0 scales by w after casting back, as Llama does; otherwise by
    (offset + w) in float32 before the cast, as Gemma does."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig, theta: float | None = None, long: bool = False) -> torch.Tensor:
    """The rotary frequencies of full-attention layers, or with `theta` a sliding layer's own base (unscaled).
    `long`: longrope's frequencies past original_max_position_embeddings."""
    dim = cfg.rotary_dim
    base = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    rs = cfg.rope_scaling
    if theta is not None or rs is None:
        return 1.0 / ((theta or cfg.rope_theta) ** base)
    if rs.rope_type == "longrope":
        factors = torch.tensor(rs.long_factor if long else rs.short_factor, dtype=torch.float32)
        return 1.0 / (factors * cfg.rope_theta ** base)
    inv_freq = 1.0 / (cfg.rope_theta ** base)
    if rs.rope_type == "linear":
        return inv_freq / rs.factor
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _angles(inv_freq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return torch.cat([freqs, freqs], dim=-1)


def rope_tables(cfg: ModelConfig, max_seq_len: int, dtype: torch.dtype, device: torch.device):
    """cos/sin for every position, computed once: a step only gathers rows by position. (max_seq_len, rotary_dim),
    or with a sliding layers' base of their own (Gemma 3) (max_seq_len, 2, rotary_dim): [:, 0] full-attention
    layers', [:, 1] sliding layers' (Attention picks its own by a per-layer tensor, so layers share one graph)."""
    positions = torch.arange(max_seq_len)
    emb = _angles(rope_inv_freq(cfg), positions)
    scale = 1.0
    rs = cfg.rope_scaling
    if rs is not None and rs.rope_type == "longrope":
        # Long frequencies from original_max_position_embeddings on. transformers picks one set for a whole forward
        # by its last position, so this matches it token by token in decode, and for prompts that stay on one side.
        long = positions >= rs.original_max_position_embeddings
        emb = torch.where(long[:, None], _angles(rope_inv_freq(cfg, long=True), positions), emb)
        scale = rs.attention_factor
    if cfg.rope_local_theta is not None:
        emb = torch.stack([emb, _angles(rope_inv_freq(cfg, cfg.rope_local_theta), positions)], dim=1)
    return ((emb.cos() * scale).to(dtype=dtype, device=device), (emb.sin() * scale).to(dtype=dtype, device=device))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (T, heads, head_dim); cos/sin: (T, rotary_dim), rotary_dim <= head_dim (partial rotary: the rest passes)
    dim = cos.shape[-1]
    rot = x if dim == x.shape[-1] else x[..., :dim]
    half = dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    out = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return out if dim == x.shape[-1] else torch.cat([out, x[..., dim:]], dim=-1)


class LoRALinear(nn.Module):
    """A linear layer (optionally several fused ones: qkv, gate_up) plus stacked LoRA slots.

    `lora_a_stack[s]` is device slot s's A, (c·max_rank, in), and `lora_b[s]` its B transposed, scaling folded in:
    (max_rank, out), every slice's B in its own columns, or with `block_diagonal_b` (c·max_rank, out), slice i's B in
    rows i·max_rank.. and its own columns, zeros elsewhere, so that one GEMM expands every slice at once (the CUDA
    kernels; c× the bytes, so the CPU keeps the compact form). With `b_chunk` (the CPU's indexed kernel in
    bfloat16, compile_policy.lora_b_chunk) the compact form is stored chunk-major, (out / b_chunk, max_rank,
    b_chunk): each b_chunk-wide run of outputs has its rank rows in one contiguous block, which the expand reads
    front to back. Slot 0 is the base model: its rows stay zero. Ranks below max_rank are zero-padded. Everything
    constant is a buffer created here: nothing is rebuilt per batch.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: tuple[int, ...],
        bias: bool,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        block_diagonal_b: bool = False,
        b_chunk: int = 0,
        quant: str = "none",
        group_size: int = 0,
        stacked_a: bool = False,
        gathered: bool = False,
    ):
        super().__init__()
        self.output_sizes = tuple(output_sizes)  # the one table every slice of this layer derives from
        # Where each packed module's output starts: [0, q, q+kv, q+2kv] for qkv, [0, i, 2i] for gate_up.
        offsets = torch.tensor((0, *self.output_sizes), dtype=torch.int64).cumsum(0)
        out_features = int(offsets[-1])
        self.in_features, self.out_features = in_features, out_features
        self.max_rank = max_rank
        self.slot_rows = len(output_sizes) * max_rank  # rows of A per slot
        n_stored = max_loras + 1  # slot 0, the base model's zero rows, + device slots 1..max_loras
        # The base weight in one form (quantization): full width, or packed codes and their scales (load_quantized).
        self.quant, self.group_size = quant, group_size
        # The "stacked" LoRA kernel (full-width weights only): every slot's A rows stored under the base weight's,
        # one tensor, so that one GEMM gives a token's base output and its shrink through every slot at once
        # (lora_deltas.gathered). `weight` and `lora_a_stack` are then tensors over its memory (_rows_of), which the
        # step never reads: it reads weight_stacked alone (a compiled region's inputs may not alias one another).
        stacked_rows = n_stored * self.slot_rows if stacked_a and quant == "none" else 0
        stacked = (torch.zeros(out_features + stacked_rows, in_features, dtype=dtype, device=device) if stacked_rows
                   else None)
        if quant == "none":
            weight = (_rows_of(stacked, 0, (out_features, in_features)) if stacked_rows
                      else torch.empty(out_features, in_features, dtype=dtype, device=device))
            self.weight = nn.Parameter(weight, requires_grad=False)
        else:
            self.register_parameter("weight", None)
        self.register_buffer("weight_stacked", stacked, persistent=False)
        self.register_buffer("qweight", None, persistent=False)
        self.register_buffer("qscales", None, persistent=False)
        # The group size as a tensor too, which Inductor's AMX template for int4 reads (quantization.amx_tiles).
        self.register_buffer("qgroup", torch.tensor(group_size, device=device) if quant != "none" else None,
                             persistent=False)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )
        # Its own storage, not rows appended to the weight (except stacked, above): the compiled layer is a nested
        # region, and a region's inputs may not alias one another.
        a_stack = (_rows_of(stacked, out_features, (n_stored, self.slot_rows, in_features)) if stacked_rows
                   else torch.zeros(n_stored, self.slot_rows, in_features, dtype=dtype, device=device))
        self.register_buffer("lora_a_stack", a_stack, persistent=False)
        self.register_buffer("output_offset", offsets.to(device), persistent=False)
        # output_offset's only reader, at construction: no step needs offsets as a tensor (docs/architecture.md).
        bounds = offsets.tolist()
        self._slices = tuple(zip(bounds[:-1], bounds[1:]))  # what the slot loaders and LoRA paths slice by
        # B transposed, output dim innermost: the expand then vectorises over outputs and sums over the rank
        # with no horizontal reduction per output (python -m benchmarks.lora_layer).
        self.block_diagonal_b = block_diagonal_b
        b_rows = self.slot_rows if block_diagonal_b else max_rank
        if b_chunk and (block_diagonal_b or any(size % b_chunk for size in self.output_sizes)):
            raise ValueError(f"b_chunk {b_chunk} needs the compact B and slices in multiples of it: {output_sizes}")
        self.b_chunk = b_chunk
        b_shape = (out_features // b_chunk, b_rows, b_chunk) if b_chunk else (b_rows, out_features)
        self.register_buffer("lora_b", torch.zeros(n_stored, *b_shape, dtype=dtype, device=device), persistent=False)
        # DoRA: each slot's per-output rescale g = magnitude / ||W + B·A|| (row norms), computed when the slot is
        # loaded; 1 for plain LoRA slots and the base model's slot 0, where the forward then computes exactly what
        # it computes without DoRA (forward).
        self.register_buffer("dora_scale", torch.ones(n_stored, out_features, dtype=dtype, device=device),
                             persistent=False)
        self.max_loras = max_loras
        # The "gathered" and "stacked" kernels' expand (lora_deltas.gathered): each token's own slot's shrink and B
        # read by index inside one reduction (compile_policy.GATHERED_KERNELS).
        self.gathered = gathered
        # oneDNN-packed copy of the base weight (CPU float32, see packed_gemm), set by prepack() after loading;
        # while a lone adapter runs merged (lora/merge.py), weight_packed is that adapter's merged pack.
        self.register_buffer("weight_packed", None, persistent=False)

    def b_rows(self, i: int) -> slice:
        """The rows of a slot's B that hold slice i's (its columns are self._slices[i])."""
        start = i * self.max_rank if self.block_diagonal_b else 0
        return slice(start, start + self.max_rank)

    def b_matrix(self, slot: int) -> torch.Tensor:
        """Slot `slot`'s B as (rows, out), whatever its stored layout: a view, or chunk-major a copy (loads, merges
        and the eager path read it; the compiled step reads the stored layout)."""
        b = self.lora_b[slot]
        return b.permute(1, 0, 2).reshape(b.shape[1], -1) if self.b_chunk else b

    def _b_slice(self, slot: int, i: int) -> torch.Tensor:
        """A writable view of slot `slot`'s B for slice i: (max_rank, out_i); chunk-major (max_rank, chunks,
        b_chunk)."""
        start, end = self._slices[i]
        if self.b_chunk:
            return self.lora_b[slot, start // self.b_chunk:end // self.b_chunk, self.b_rows(i)].transpose(0, 1)
        return self.lora_b[slot, self.b_rows(i), start:end]

    def b_all_slots(self, i: int) -> torch.Tensor:
        """Every stored slot's B for slice i as (slots, max_rank, out_i), contiguous (a grouped GEMM's right
        operand): a copy of ~slots x rank x out_i values (chunk-major, re-laid; compact, its columns)."""
        start, end = self._slices[i]
        if self.b_chunk:
            k = self.b_chunk
            b = self.lora_b[:, start // k:end // k, self.b_rows(i)].transpose(1, 2)  # (slots, r, chunks, k)
            return b.reshape(b.shape[0], self.max_rank, end - start)
        return self.lora_b[:, self.b_rows(i), start:end].contiguous()

    @torch.no_grad()
    def prepack(self) -> None:
        if self.weight is not None:  # (a quantized weight is in its kernel's layout already)
            self.weight_packed = prepack(self.weight)

    @torch.no_grad()
    def load_quantized(self, qt: quantization.QuantizedTensor) -> None:
        """The base weight as codes and scales (this projection's form), packed for the device's kernel."""
        if (qt.kind, qt.shape) != (self.quant, (self.out_features, self.in_features)):
            raise ValueError(f"expected a {self.quant} weight of {(self.out_features, self.in_features)}, got "
                             f"{qt.kind} {qt.shape}")
        dtype = self.lora_a_stack.dtype
        self.qweight, self.qscales = quantization.pack(qt, dtype, self.lora_a_stack.device)

    @property
    def weight_nbytes(self) -> int:
        """Memory the base weight takes (packed copies not counted)."""
        if self.weight is not None:
            return self.weight.numel() * self.weight.element_size()
        return quantization.nbytes(self.qweight, self.qscales)

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        """x·Wᵀ, without the bias."""
        if self.quant != "none":  # (not `self.weight is None`: a stacked weight is an alias the step must not read)
            return quantization.linear(x, self.quant, self.qweight, self.qscales, self.group_size,
                                       padding_rows=DUMMY_TOKENS, group=self.qgroup)
        if self.weight_stacked is not None:  # (the step reads the stacked tensor alone: the weight is its first rows)
            return linear(x, self.weight_stacked[:self.out_features], self.weight_packed)
        return linear(x, self.weight, self.weight_packed)

    def _biased(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias

    @torch.no_grad()
    def merged_weight(self, slot: int) -> torch.Tensor:
        """g ⊙ (W + B·A) for slot `slot` (scaling folded in; g its DoRA rescale, else 1), (out, in): the weight a
        token of that adapter sees."""
        a_rows, b = self.lora_a(slot), self.b_matrix(slot)
        merged = self.weight.clone()
        for i, (start, end) in enumerate(self._slices):
            merged[start:end] += b[self.b_rows(i), start:end].T @ a_rows[i * self.max_rank : (i + 1) * self.max_rank]
        return merged * self.dora_scale[slot][:, None]

    def lora_a(self, slot: int) -> torch.Tensor:
        """Slot `slot`'s stacked A rows, (c·max_rank, in): a view into lora_a_stack."""
        if not 1 <= slot <= self.max_loras:  # slot 0 is the base model's: its rows stay zero
            raise ValueError(f"LoRA slot must be in [1, {self.max_loras}], got {slot}")
        return self.lora_a_stack[slot]

    def forward(self, x: torch.Tensor, lora: LoRABatch, compiled: bool = False) -> torch.Tensor:
        """`compiled`: inside a compiled graph (ForwardBatch.compiled), where the indexed LoRA form is the cheap one.
        A batch with segments (the grouped kernel, compile_policy.lora_kernel) takes grouped GEMMs, compiled or not."""
        if lora.weight_indices is None:  # base-model-only step: its own graph, with no LoRA work at all
            return self._biased(self._base(x))
        if self.weight_stacked is not None:  # one GEMM: the base output, then every slot's shrink beside it
            # F.linear's row-major output: packed_gemm's float32 CPU form ((W x^T)^T, columns outermost), sliced
            # and reshaped inside the compiled stack's layer region, gave wrong tokens on torch 2.13's CPU.
            both = F.linear(x, self.weight_stacked)
            base = both[:, :self.out_features]
            delta = lora_deltas.gathered(self, both[:, self.out_features:], lora.weight_indices)
        else:
            base = self._base(x)
            delta = self._delta(x, lora, compiled)
        # DoRA as PEFT computes it: x·Wᵀ + bias + ((g - 1) ⊙ x·Wᵀ + g ⊙ Δ). Where g is 1 (plain LoRA, the base)
        # that is x·Wᵀ + bias + Δ to the last bit, as before DoRA; Inductor fuses it into the add it replaces.
        g = self.dora_scale[lora.weight_indices]
        return self._biased(base) + ((g - 1) * base + g * delta)

    def _delta(self, x: torch.Tensor, lora: LoRABatch, compiled: bool) -> torch.Tensor:
        """The step's LoRA delta by the model's kernel, the base product apart."""
        if self.gathered:  # every slot's shrink in one GEMM, each token's own read back in the expand
            return lora_deltas.gathered(self, lora_deltas.shrink_all_slots(self, x), lora.weight_indices)
        if lora.segment_offsets is not None:
            return lora_deltas.grouped(self, x, lora, compiled)
        if lora.slot_mask is not None:
            return lora_deltas.masked(self, x, lora.slot_mask)
        return (lora_deltas.indexed if compiled else lora_deltas.segmented)(self, x, lora.weight_indices)

    @torch.no_grad()
    def load_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None],
                  magnitudes: list[torch.Tensor | None] | None = None) -> None:
        """Copy one adapter into `slot` (>= 1) in place (same tensors: nothing recompiles).

        parts[i] is (A (r, in), B_scaled (out_i, r)) for output slice i, or None where the adapter lacks it;
        magnitudes[i] a DoRA adapter's magnitude (out_i,) for slice i.
        """
        self.clear_slot(slot)
        a_rows = self.lora_a(slot)
        for i, part in enumerate(parts):
            if part is None:
                continue
            a_part, b_part = part
            # From pinned host memory on CUDA: queued on the current (copy) stream, no host sync.
            a_part = a_part.to(a_rows.device, a_rows.dtype, non_blocking=True)
            b_part = b_part.to(a_rows.device, a_rows.dtype, non_blocking=True)
            r = a_part.shape[0]
            a_rows[i * self.max_rank : i * self.max_rank + r].copy_(a_part)
            b_slice = self._b_slice(slot, i)[:r]
            b_slice.copy_(b_part.T.reshape(b_slice.shape))
            if magnitudes is not None and magnitudes[i] is not None:
                self._load_dora_scale(slot, i, a_part, b_part, magnitudes[i])

    def _load_dora_scale(self, slot: int, i: int, a: torch.Tensor, b: torch.Tensor, magnitude: torch.Tensor) -> None:
        """g = magnitude / ||W + B·A|| per output row of slice i, once per slot load (a constant of the slot, as
        PEFT's is once per weight): W + B·A is formed in float32 a bounded run of rows at a time."""
        start, end = self._slices[i]
        a32, b32 = a.float(), b.float()
        norms = torch.empty(end - start, dtype=torch.float32, device=a.device)
        rows = max(1, (1 << 24) // self.in_features)  # ~64 MiB of float32 at a time
        for first in range(0, end - start, rows):
            last = min(first + rows, end - start)
            w = self.weight[start + first:start + last].float() + b32[first:last] @ a32
            norms[first:last] = torch.linalg.vector_norm(w, dim=1)
        magnitude = magnitude.to(norms.device, torch.float32, non_blocking=True)
        self.dora_scale[slot, start:end].copy_(magnitude / norms)

    @torch.no_grad()
    def clear_slot(self, slot: int) -> None:
        self.lora_a(slot).zero_()
        self.lora_b[slot].zero_()
        self.dora_scale[slot].fill_(1)


def _rows_of(stacked: torch.Tensor, first_row: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over `stacked`'s memory from row `first_row` on, contiguous, of `shape`: the same memory, made with
    set_ rather than by slicing, so that the weight Parameter is not a view whose base is the whole stacked tensor."""
    alias = torch.empty(0, dtype=stacked.dtype, device=stacked.device)
    return alias.set_(stacked.untyped_storage(), stacked.storage_offset() + first_row * stacked.shape[1], shape)
