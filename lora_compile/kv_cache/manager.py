"""KVCacheManager: each sequence's block table, prefix-cache hits at admission, growth as it decodes, and freeing.

A sequence's `block_table` lists the blocks that hold its positions in order (position p lives in row
`block_table[p // block_size] * block_size + p % block_size` of the layers' flattened pools). Blocks fill in
order; once a block's every position is computed it is cached under its chained hash (hashing.py), so a later
sequence with the same root (adapter weights) and the same leading tokens starts past it: `num_computed_tokens`
begins at the hit. The last known token is always computed again (its logits sample the next token), so a hit
never covers it and no sequence ever writes into a block it shares.
"""
from __future__ import annotations

from ..sequence import Sequence
from .block_pool import BlockPool
from .hashing import BASE_MODEL_KEY, activation_hash, block_hashes, root_hash
from .sizing import KVCacheSize


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, size: KVCacheSize, enable_prefix_caching: bool = True):
        self.size = size
        self.block_size = size.block_size
        self.num_blocks = size.num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(size.num_blocks)
        # Monotonic counters, in tokens (vLLM's prefix_cache_queries / hits): first admissions only.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_tokens(self) -> int:
        return self.size.num_tokens

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Share of the usable blocks held by sequences (cached free blocks count as free, as in vLLM)."""
        return 1.0 - self.pool.num_free / self.num_blocks

    # --- admission ----------------------------------------------------------------------------------
    def _hashes(self, seq: Sequence, n_blocks: int) -> list[bytes]:
        """The hashes of seq's first `n_blocks` full blocks of known tokens (extended and kept on the sequence)."""
        have, bs = len(seq.block_hashes), self.block_size
        if have >= n_blocks:
            return seq.block_hashes[:n_blocks]
        tokens = seq.tokens(0, n_blocks * bs)
        if seq.adapter_start == 0:  # one chain from its weights' root
            parent = seq.block_hashes[-1] if have else seq.cache_root
            seq.block_hashes += block_hashes(parent, tokens, bs, have, n_blocks)
            return seq.block_hashes
        # An activated adapter: the base model's chain up to the block where it starts acting, then its own.
        switch = min(seq.adapter_start // bs, n_blocks)
        parent = seq.block_hashes[-1] if have else root_hash(BASE_MODEL_KEY)
        if have < switch:
            seq.block_hashes += block_hashes(parent, tokens, bs, have, switch)
            have, parent = switch, seq.block_hashes[-1]
        if have < n_blocks:
            if have == switch:
                parent = activation_hash(parent, seq.cache_root, seq.adapter_start % bs)
            seq.block_hashes += block_hashes(parent, tokens, bs, have, n_blocks)
        return seq.block_hashes

    def allocate(self, seq: Sequence, cache_key: bytes, num_tokens: int, keep_free: int = 0) -> bool:
        """Give `seq` (holding no blocks) the blocks for its first `num_tokens` positions: cached ones for the
        longest hit among its known tokens, free ones for the rest. False, with nothing taken, when fewer than
        that plus `keep_free` are free. Sets seq.num_computed_tokens to the hit. An activated adapter's
        seq.adapter_start is set before (its blocks before that are the base model's)."""
        assert not seq.block_table, "sequence already holds KV blocks"
        root = root_hash(cache_key)
        if (root, seq.adapter_start) != (seq.cache_root, seq.cache_adapter_start):
            # first admission, or other weights since: hashes start again
            seq.cache_root, seq.cache_adapter_start, seq.block_hashes = root, seq.adapter_start, []
        hits: list[int] = []
        # A sequence still owed prompt log-probabilities computes every prompt position: it reads no cached block
        # (vLLM's skip_reading_prefix_cache), though it still offers its own blocks to the cache.
        reading = self.enable_prefix_caching and not seq.prompt_logprobs_pending
        if reading:
            hits = self.pool.lookup(self._hashes(seq, (seq.num_tokens - 1) // self.block_size))
        need = _blocks_for(num_tokens, self.block_size) - len(hits)
        evictable_hits = sum(1 for b in hits if self.pool.ref_cnt[b] == 0)  # free now, held once hit
        if need + keep_free > self.pool.num_free - evictable_hits:
            return False
        self.pool.touch(hits)
        seq.block_table = hits + self.pool.take(max(0, need))
        seq.num_computed_tokens = len(hits) * self.block_size
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
            if reading:  # (as vLLM: a sequence that skips the lookup is no query)
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += seq.num_computed_tokens
        return True

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `allocate` would succeed if nothing else changed, without hashing: a lower bound on hits is 0,
        so this is exact only without prefix caching; admission calls allocate itself."""
        return _blocks_for(num_tokens, self.block_size) <= self.pool.num_free

    # --- running ------------------------------------------------------------------------------------
    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for positions up to `num_tokens` (decode: its next); False, nothing taken, when none is free."""
        need = _blocks_for(num_tokens, self.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        seq.block_table += self.pool.take(need)
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Cache the blocks `seq` has filled since the last call (all their positions computed)."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        done = seq.num_cached_blocks
        if full <= done:
            return
        for i, h in enumerate(self._hashes(seq, full)[done:], start=done):
            self.pool.cache(seq.block_table[i], h)
        seq.num_cached_blocks = full

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq`, its tail first (evicted before the prefix others may share)."""
        if seq.block_table:
            self.pool.free(seq.block_table[::-1])
        seq.block_table = []
        seq.num_cached_blocks = 0
