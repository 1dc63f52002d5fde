"""How many KV blocks the pool has: a memory budget divided by what one block takes in every layer.

The default budget (EngineConfig.kv_cache_memory None):
- CPU: KV_HOST_SHARE of the memory available at start, at most KV_HOST_MAX_BYTES (vLLM-CPU's default KV space);
- CUDA: like vLLM's --gpu-memory-utilization, the share `gpu_memory_utilization` of the device's memory minus what
  is in use once weights and adapter slots are allocated;
and in both cases no more blocks than KV_MAX_SEQ_FILLS x max_num_seqs x max_seq_len tokens need: beyond that a
default pool would only hold old prefixes. An explicit budget is taken as given.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import EngineConfig, ModelConfig
from ..host_memory import available_memory_bytes

KV_HOST_SHARE = 0.25
KV_HOST_MAX_BYTES = 4 << 30
KV_MAX_SEQ_FILLS = 2


@dataclass(frozen=True)
class KVCacheSize:
    num_blocks: int        # usable blocks (the null block is extra)
    block_size: int
    bytes_per_block: int   # K and V, every layer

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return (self.num_blocks + 1) * self.bytes_per_block

    def describe(self, dtype: torch.dtype) -> str:
        """For the start log: `63 blocks of 32 tokens (2016 tokens, 8.0 MiB, float32)`."""
        return (f"{self.num_blocks} blocks of {self.block_size} tokens ({self.num_tokens} tokens, "
                f"{format_bytes(self.nbytes)}, {str(dtype).removeprefix('torch.')})")


def bytes_per_block(mc: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    item = torch.empty((), dtype=dtype).element_size()
    return 2 * mc.num_hidden_layers * block_size * mc.num_key_value_heads * mc.head_dim * item


def _default_budget(config: EngineConfig, device: torch.device) -> int:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free - total * (1 - config.gpu_memory_utilization))
    available = available_memory_bytes()
    return min(int((available or 4 << 30) * KV_HOST_SHARE), KV_HOST_MAX_BYTES)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def kv_cache_size(config: EngineConfig, mc: ModelConfig, dtype: torch.dtype, device: torch.device) -> KVCacheSize:
    bs = config.block_size
    per_block = bytes_per_block(mc, bs, dtype)
    seq_blocks = -(-config.max_seq_len // bs)  # one sequence of max_seq_len
    if config.kv_cache_memory is not None:
        num_blocks = config.kv_cache_memory // per_block - 1
        source = f"--kv-cache-memory {format_bytes(config.kv_cache_memory)}"
    else:
        cap = KV_MAX_SEQ_FILLS * config.max_num_seqs * seq_blocks
        num_blocks = min(cap, max(0, _default_budget(config, device)) // per_block - 1)
        source = "the default KV budget"
    if num_blocks < seq_blocks:
        raise ValueError(
            f"{source} holds {max(0, num_blocks)} KV blocks of {bs} tokens ({format_bytes(per_block)} each), fewer "
            f"than one sequence of max_seq_len {config.max_seq_len} needs ({seq_blocks} blocks, "
            f"{format_bytes((seq_blocks + 1) * per_block)}): raise --kv-cache-memory or lower --max-seq-len")
    return KVCacheSize(num_blocks, bs, per_block)
