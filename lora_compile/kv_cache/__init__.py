"""The paged KV cache's bookkeeping (vLLM v1's KVCacheManager / BlockPool, nano-vllm's BlockManager): which
fixed-size blocks of the layers' K/V pools each sequence holds, and which full blocks are cached by content.

The tensors themselves live in the attention layers, `(num_blocks, block_size, n_kv, head_dim)` each; this package
never touches them. Block 0 is the null block: padding tokens write there and padded block-table entries point
there (its values are never used: attention replaces what it must not read).
"""
from .block_pool import BlockPool
from .hashing import block_hashes, root_hash
from .manager import KVCacheManager
from .sizing import KVCacheSize, kv_cache_size

__all__ = ["BlockPool", "KVCacheManager", "KVCacheSize", "block_hashes", "kv_cache_size", "root_hash"]
