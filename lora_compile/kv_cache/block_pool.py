"""The pool of KV blocks: reference counts, the free queue (least recently freed first), and the cached blocks by
hash. A freed block keeps its hash and stays findable until it is taken again (vLLM's evictable blocks)."""
from __future__ import annotations

from collections import OrderedDict

NULL_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int):
        """`num_blocks` usable blocks, ids 1..num_blocks; id 0 is the null block."""
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * (num_blocks + 1)
        self.block_hash: list[bytes | None] = [None] * (num_blocks + 1)
        self.cached: dict[bytes, int] = {}
        # Free blocks, oldest first: taking a block evicts the least recently freed cached content.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks + 1))

    @property
    def num_free(self) -> int:
        """Blocks not held by any sequence (cached or not): what can be taken now."""
        return len(self._free)

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (not yet held)."""
        hits = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def touch(self, blocks: list[int]) -> None:
        """Hold cached blocks (a prefix hit): out of the free queue while any sequence holds them."""
        for b in blocks:
            if self.ref_cnt[b] == 0:
                del self._free[b]
            self.ref_cnt[b] += 1

    def take(self, n: int) -> list[int]:
        """`n` free blocks, held; each loses its cached content. The caller checks num_free first."""
        assert n <= len(self._free), "not enough free KV blocks"
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                self.block_hash[b] = None
                if self.cached.get(h) == b:
                    del self.cached[h]
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def free(self, blocks: list[int]) -> None:
        """Release one hold on each block, in the order given (the caller passes a sequence's blocks last first,
        so its tail is evicted before the prefix others are likelier to share)."""
        for b in blocks:
            self.ref_cnt[b] -= 1
            assert self.ref_cnt[b] >= 0, "KV block freed more often than taken"
            if self.ref_cnt[b] == 0:
                self._free[b] = None

    def cache(self, block: int, block_hash: bytes) -> None:
        """Make a held, fully written block findable by its hash (a block whose content is cached already under
        another id stays uncached: the first copy serves later hits)."""
        if self.block_hash[block] is None and block_hash not in self.cached:
            self.block_hash[block] = block_hash
            self.cached[block_hash] = block

    def reset_cache(self) -> None:
        """Forget every cached hash (e.g. the base model's weights changed)."""
        self.cached.clear()
        self.block_hash = [None] * (self.num_blocks + 1)
